"""What runs on the Ray cluster: job entrypoints, the training loop, checkpoints, data reading, the config.

Never imports prefect: Prefect is not installed on workers.
"""
