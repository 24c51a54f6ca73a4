"""`lazarus simulate`: goodput of Lazarus and checkpoint-based baselines under failure traces.

Pure logic (traces, throughput, strategies, engine) is separate from I/O (config files,
plots, the report); nothing here imports torch.
"""
