"""The Redis contract between the API and the workers: key names, message schemas, intake and output."""
