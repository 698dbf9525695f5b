"""The device side of one step: the model runner, the step's batch on the device, the KV pool,
CUDA graphs, sampling, and the TP broadcast of a step."""
