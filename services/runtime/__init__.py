"""What every worker process runs on, whichever service it is: the engine's thread and its core
lease, the Redis intake and the token stream back to the gateways, health, KV events and memory
tuning. The services (prefill/, decode/, colocated/) are thin wiring around it."""
