"""One module per framework and API family; each has ``run(question, system, model) -> str``."""
