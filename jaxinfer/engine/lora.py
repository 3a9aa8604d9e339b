"""LoRA adapters on the host: reading them, which are kept, and which slot of the device's table holds which.

    manager = LoraManager(runner, model_config, max_loras=4, max_rank=16, tp=1)
    manager.check(lora_request)      # read + fuse once (a bad adapter: ValueError naming it)
    manager.pin(lora_int_id) ... manager.unpin(lora_int_id)   # while a request names it
    slot = manager.slot(lora_int_id, keep={ids in use})   # load into a slot if needed (LRU)

The table has `max_loras` adapter slots (slot 0 is "none"). The scheduler never runs more than
max_loras distinct adapters at once (`Scheduler.max_loras`), so every adapter a step uses gets a
slot: one already holding it, an empty one, or the least recently used one that no running
sequence needs. Filling a slot writes the device arrays in place (`ModelRunner.write_lora_slot`):
no recompile, whatever the adapter or the slot.

Threads: requests are checked in their callers' threads (the server's workers) while the engine
thread fills slots; one lock guards the manager's state (an adapter is read and fused outside
it). Pins: an adapter is pinned while a request naming it lives, from its creation
(`InputProcessor.make_request`) until the core finishes or aborts it; the server pins it from the
moment a request names it. A pinned adapter keeps its host arrays (the engine thread may need them
to fill a slot) and cannot be removed. Host cache: the fused arrays of at most `max_cpu_loras`
adapters (default max_loras) beside the pinned ones; the least recently used unpinned one is
dropped first (a device slot holding it keeps it), and read again if a request names it later.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from checkpoints_conv.peft_adapter import AdapterError, read_lora_adapter
from jaxinfer.config import ModelConfig
from jaxinfer.lora_request import LoRARequest
from jaxinfer.models.lora import LoraTable, fuse_adapter, served_modules


class LoraManager:
    def __init__(self, runner, model_config: ModelConfig, *, max_loras: int, max_rank: int, tp: int = 1,
                 max_cpu_loras: int | None = None):
        self.runner = runner
        self.model_config = model_config
        self.table = LoraTable(max_loras + 1, max_rank)
        self.tp = tp
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras}: must be >= 1")
        self._lock = threading.Lock()
        self._requests: dict[int, LoRARequest] = {}  # lora_int_id -> the adapter it names, until removed
        # lora_int_id -> its slot arrays on the host, least recently used first
        self._fused: collections.OrderedDict[int, dict[str, np.ndarray]] = collections.OrderedDict()
        self._pins: collections.Counter[int] = collections.Counter()  # lora_int_id -> pins held
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot, least recent first
        self.num_loads = 0  # slot fills so far

    @property
    def max_loras(self) -> int:
        return self.table.num_slots - 1

    @property
    def held(self) -> list[int]:
        """The ids of the adapters whose fused arrays the host holds, least recently used first."""
        with self._lock:
            return list(self._fused)

    def check(self, request: LoRARequest) -> None:
        """Reads and fuses the adapter if the host does not hold it; ValueError (naming it) if it
        cannot be served."""
        with self._lock:
            if self._held(request):
                return
        try:  # the slow part, outside the lock: the engine thread goes on filling slots meanwhile
            adapter = read_lora_adapter(request.lora_path, num_layers=self.model_config.num_layers, max_rank=self.table.rank,
                                        modules=served_modules(self.model_config))
        except AdapterError as e:
            raise ValueError(f"LoRARequest {request.lora_name!r}: {e}") from None
        fused = fuse_adapter(self.model_config, self.table, adapter.weights, adapter.scale, self.tp)
        with self._lock:
            if self._held(request):  # another thread read it meanwhile
                return
            self._requests[request.lora_int_id] = request
            self._fused[request.lora_int_id] = fused
            self._trim(keep=request.lora_int_id)  # not the one just read: its request is about to pin it

    def _held(self, request: LoRARequest) -> bool:
        """Whether the host holds the adapter's arrays (marking them recently used); ValueError if
        its id names another adapter. Under the lock."""
        known = self._requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(f"LoRARequest {request.lora_name!r}: lora_int_id {request.lora_int_id} is already "
                             f"adapter {known.lora_path!r}")
        if request.lora_int_id not in self._fused:
            return False
        self._fused.move_to_end(request.lora_int_id)
        return True

    def pin(self, lora_int_id: int) -> None:
        """One more request names the adapter: it keeps its host arrays and cannot be removed."""
        with self._lock:
            self._pins[lora_int_id] += 1

    def unpin(self, lora_int_id: int) -> None:
        """A request naming the adapter is gone; unpinned adapters past max_cpu_loras are dropped."""
        with self._lock:
            self._pins[lora_int_id] -= 1
            if self._pins[lora_int_id] <= 0:
                del self._pins[lora_int_id]
            self._trim()

    def pins(self, lora_int_id: int) -> int:
        """How many pins the adapter has now."""
        with self._lock:
            return self._pins[lora_int_id]

    def remove(self, lora_int_id: int) -> None:
        """Forgets an adapter; its slot is free for the next one. ValueError while a request
        names it (queued, being tokenized or running)."""
        with self._lock:
            if self._pins[lora_int_id]:
                raise ValueError(f"adapter {lora_int_id} is in use ({self._pins[lora_int_id]} pins: requests queued, "
                                 f"being tokenized or running)")
            self._requests.pop(lora_int_id, None)
            self._fused.pop(lora_int_id, None)
            self._slot_of.pop(lora_int_id, None)

    def forget_slots(self) -> None:
        """The device's table was re-created empty (a failed step consumed it): every adapter is
        written into a slot again when a step next uses it."""
        with self._lock:
            self._slot_of.clear()

    def _trim(self, keep: int | None = None) -> None:
        """Drops the host arrays of the least recently used unpinned adapters (except `keep`)
        while more than max_cpu_loras are held; a slot holding one keeps it. Under the lock."""
        excess = len(self._fused) - self.max_cpu_loras
        for lora_int_id in [i for i in self._fused if i != keep and not self._pins[i]][: max(excess, 0)]:
            del self._fused[lora_int_id]

    def slot(self, lora_int_id: int, keep: set[int]) -> int:
        """The slot holding adapter `lora_int_id` (0: the base model), loading it into a free slot
        or the least recently used one outside `keep` (the adapters the step uses)."""
        if lora_int_id == 0:
            return 0
        with self._lock:
            if lora_int_id in self._slot_of:
                self._slot_of.move_to_end(lora_int_id)
                return self._slot_of[lora_int_id]
            fused = self._fused.get(lora_int_id)
            if fused is None:  # a request that names it pins it from its creation: this cannot happen
                raise RuntimeError(f"adapter {lora_int_id} is not held on the host (was it used without a pin?)")
            used = set(self._slot_of.values())
            free = [s for s in range(1, self.table.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next((i for i in self._slot_of if i not in keep), None)
                if victim is None:
                    raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")  # the scheduler prevents it
                slot = self._slot_of.pop(victim)
            self.runner.write_lora_slot(slot, fused)
            self._slot_of[lora_int_id] = slot
            self.num_loads += 1
            return slot
