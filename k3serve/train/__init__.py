"""Training at tiny scale (docs/architecture.md §16): target pretraining on a local corpus with the serving model's layers.

``corpus`` finds and splits the text, ``params`` holds the trainable tensors under their checkpoint names,
``step`` is the differentiable loss, ``balance`` the MoE bias update, ``schedule`` the learning rate,
``loop`` the training run (checkpoints, resume, eval, curves), ``evaluate`` bits per byte with the reference
forward, ``flops`` the throughput model.
"""
