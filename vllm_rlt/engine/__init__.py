"""Engines: `LLMEngine` (the step loop: schedule, execute, read back, emit) and, for servers,
`AsyncLLMEngine` (one background loop that owns it, with a stream per request)."""
