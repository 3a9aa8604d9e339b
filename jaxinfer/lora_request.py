"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's names)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """lora_name: what clients call it; lora_int_id: a positive id, unique per adapter (it keys
    the engine's slot table and the prefix cache); lora_path: a PEFT adapter folder
    (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r}: must be an integer >= 1 (0 is the base model)")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest.lora_name: must be a non-empty string")
