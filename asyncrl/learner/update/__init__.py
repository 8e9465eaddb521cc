"""The training step: the DeepSpeed-wrapped policy and reference, the padded batch, the configured algorithm's update,
the critic, low-rank adapters, and offline DPO (the losses themselves are ``learner/algorithms/``)."""
