"""Multi-LoRA serving: PEFT adapters (`adapter`), the GPU pool (`pool`), the step's
segments and the linears' hooks (`layer`), the registry and the scheduler's gate (`manager`)."""
from engine.lora.adapter import LoRAAdapter, LoRAError, LoRANotFoundError, load_adapter
from engine.lora.manager import LoRAManager

__all__ = ["LoRAAdapter", "LoRAError", "LoRANotFoundError", "LoRAManager", "load_adapter"]
