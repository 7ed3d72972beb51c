"""The GPU worker: reads intake streams, runs requests in the engine, writes output events."""
