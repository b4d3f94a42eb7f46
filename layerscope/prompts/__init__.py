"""Prompt sets: the named sets and their sampling (`sets`), prompt files (`files`), ShareGPT (`sharegpt`), one record's shape (`record`)."""
