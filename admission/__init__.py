"""Admission: a neutral request becomes a ``RequestMessage`` or a clear refusal (no HTTP, no Redis writes).

The API maps OpenAI bodies onto it, the batch-job runner admits its chunk requests with it, and the
simulator admits its trace with it: one set of rules for tier, tokens, context length, bucket,
predicted output length, deadline and load shedding.
"""
