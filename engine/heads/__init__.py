"""Drafts trained on the target's own answers, as stages a reader can follow in order:
prompts.py -> answers.py -> data.py (the one data object) -> vocab.py -> trainer.py (EAGLE heads) ->
evaluate.py, tied together and cached by pipeline.py. medusa_train.py and draft_model_train.py
train the other drafts on the same data and cache; schedule.py is what all three trainers share
(split, schedule, early stop); drafts.py picks a method's trainer."""
