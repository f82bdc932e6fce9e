"""Draft heads trained on the target's own answers, as stages a reader can follow in order:
prompts.py -> answers.py -> data.py (the one data object) -> vocab.py -> trainer.py -> evaluate.py,
tied together and cached by pipeline.py."""
