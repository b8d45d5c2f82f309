"""Three departures from EAGLE-3's and SpecForge's training recipe, as options; the defaults are EAGLE-3's.

None changes the exported drafter or what serving it costs:

- ``head_init: target``: the drafter's ``lm_head`` and final ``norm`` start as the target's own (its lm_head
  rows of the draft vocabulary, its final norm), so that the drafter predicts through the target's output map
  from the first step. The default, ``random``, is how SpecForge starts them. A drafter narrower or wider than
  its target cannot take the target's (its head starts at random, said in the log).
- ``teacher_temperature``: the soft targets are the softmax of the target's draft-vocabulary logits divided by
  this. Below 1 they lean toward the target's top-1, which is the one token a greedy verify accepts. The
  default, 1, is EAGLE-3's plain distillation. The top-1 itself, and so every accuracy and the walked
  prediction, do not depend on it.
- ``step_decay``: the loss weighs the k-th training-time-test step by this to the power k. The default is 0.5;
  EAGLE-3's and SpecForge's is 0.8. A greedy chain accepts position k only where positions 1..k-1 were
  accepted, and these drafters accept a third or less at position 1, so lower values put the weight where the
  accepted tokens are.

Measured on SmolLM2/ShareGPT against EAGLE-3's recipe, two seeds each and SpecForge's trainer on the same stored
states (docs/benchmarks.md, "Two recipe changes against EAGLE-3's" and "The step decay"): the head start and the
teacher temperature served no more than the spread of the seeds, so those defaults stay EAGLE-3's; a step decay
of 0.5 served 2 % more at chains of 3 and 7, several times that spread, so it is the default.
"""

HEAD_INITS = ("target", "random")
DEFAULT_HEAD_INIT = "random"
DEFAULT_TEACHER_TEMPERATURE = 1.0
# The loss weighs the k-th TTT step by this to the power k.
DEFAULT_STEP_DECAY = 0.5
# EAGLE-3's and SpecForge's weighing (SpecForge's ``ploss_decay``): a run at it keeps the fingerprint that runs had
# before the option existed, so their checkpoints still resume.
EAGLE3_STEP_DECAY = 0.8
