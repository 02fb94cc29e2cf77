"""Package data: the shipped trained checkpoint ``tiny-trained/`` (preset ``tiny-trained``; settings in its train_log.json) and its
EAGLE-3 drafters ``tiny-trained-drafter/`` (LK) and ``tiny-trained-drafter-kl/`` (KL baseline, docs/speculative.md)."""
