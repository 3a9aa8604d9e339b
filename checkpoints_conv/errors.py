"""The one error type of checkpoints_conv.

Every failure to read, map or check a checkpoint raises `CheckpointError` with a message that
names the thing at fault: the file, the tensor, the parameter, the shapes, the GGUF type.
"""


class CheckpointError(ValueError):
    """A checkpoint could not be read, mapped or checked. The message says which file/tensor and why."""
