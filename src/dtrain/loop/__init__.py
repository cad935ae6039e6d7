"""The training loop and what it steps: the Trainer, its state, gradients, optimizers and
schedules, EMA weights, early stopping and the one evaluation that `dtrain eval` shares."""
