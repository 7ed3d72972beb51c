"""The batch-job producer: the arq worker (``tailcut jobs``) that fans a log out into background-tier
requests through the intake streams and gathers the answers. It loads no engine; GPU workers run the
requests."""
