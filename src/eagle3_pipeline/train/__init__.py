"""Training: the EAGLE-3 drafter, its draft vocabulary, the training-time-test objective."""
