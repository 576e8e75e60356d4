"""What executes a step: data parallelism with ZeRO 0-3 and gradient buckets, the pipeline
schedules and their runtime, mixed precision and the loss scaler.
"""
