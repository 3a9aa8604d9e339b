"""LoRA adapters on the host: reading them, and which slot of the device's table holds which.

    manager = LoraManager(runner, model_config, max_loras=4, max_rank=16, tp=1)
    manager.check(lora_request)      # read + fuse once (a bad adapter: ValueError naming it)
    slot = manager.slot(lora_request, keep={ids in use})   # load into a slot if needed (LRU)

The table has `max_loras` adapter slots (slot 0 is "none"). The scheduler never runs more than
max_loras distinct adapters at once (`Scheduler.max_loras`), so every adapter a step uses gets a
slot: one already holding it, an empty one, or the least recently used one that no running
sequence needs. Filling a slot writes the device arrays in place (`ModelRunner.write_lora_slot`):
no recompile, whatever the adapter or the slot.
"""

from __future__ import annotations

import collections

import numpy as np

from checkpoints_conv.peft_adapter import AdapterError, read_lora_adapter
from jaxinfer.config import ModelConfig
from jaxinfer.lora_request import LoRARequest
from jaxinfer.models.lora import LoraTable, fuse_adapter, served_modules


class LoraManager:
    def __init__(self, runner, model_config: ModelConfig, *, max_loras: int, max_rank: int, tp: int = 1):
        self.runner = runner
        self.model_config = model_config
        self.table = LoraTable(max_loras + 1, max_rank)
        self.tp = tp
        self._fused: dict[int, dict[str, np.ndarray]] = {}  # lora_int_id -> its slot arrays (host)
        self._requests: dict[int, LoRARequest] = {}
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot, least recent first
        self.num_loads = 0  # slot fills so far

    @property
    def max_loras(self) -> int:
        return self.table.num_slots - 1

    def check(self, request: LoRARequest) -> None:
        """Reads and fuses the adapter if it is new; ValueError (naming it) if it cannot be served."""
        known = self._requests.get(request.lora_int_id)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise ValueError(f"LoRARequest {request.lora_name!r}: lora_int_id {request.lora_int_id} is already "
                                 f"adapter {known.lora_path!r}")
            return
        try:
            adapter = read_lora_adapter(request.lora_path, num_layers=self.model_config.num_layers, max_rank=self.table.rank,
                                        modules=served_modules(self.model_config))
        except AdapterError as e:
            raise ValueError(f"LoRARequest {request.lora_name!r}: {e}") from None
        self._fused[request.lora_int_id] = fuse_adapter(self.model_config, self.table, adapter.weights, adapter.scale, self.tp)
        self._requests[request.lora_int_id] = request

    def remove(self, lora_int_id: int) -> None:
        """Forgets an adapter; its slot is free for the next one (no sequence points at it once
        the caller has no request of it left)."""
        self._fused.pop(lora_int_id, None)
        self._requests.pop(lora_int_id, None)
        self._slot_of.pop(lora_int_id, None)

    def slot(self, lora_int_id: int, keep: set[int]) -> int:
        """The slot holding adapter `lora_int_id` (0: the base model), loading it into a free slot
        or the least recently used one outside `keep` (the adapters the step uses)."""
        if lora_int_id == 0:
            return 0
        if lora_int_id in self._slot_of:
            self._slot_of.move_to_end(lora_int_id)
            return self._slot_of[lora_int_id]
        used = set(self._slot_of.values())
        free = [s for s in range(1, self.table.num_slots) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self._slot_of if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")  # the scheduler prevents it
            slot = self._slot_of.pop(victim)
        self.runner.write_lora_slot(slot, self._fused[lora_int_id])
        self._slot_of[lora_int_id] = slot
        self.num_loads += 1
        return slot
