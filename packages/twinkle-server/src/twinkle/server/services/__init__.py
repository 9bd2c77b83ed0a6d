"""What the server does with requests: the model pool, the scheduler that batches tenants, futures, data."""
