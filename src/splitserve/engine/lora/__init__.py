"""LoRA adapters on one base model (issue 46): `adapter.py` reads a PEFT directory into the model's
fused slots and names it by its content."""
