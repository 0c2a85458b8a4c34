"""Bringing your own agent: the ``cyclebox init`` scaffold, manifests built by command, and
the JSON schemas of every file a project writes or reads (``cyclebox schema NAME``).

Nothing here runs a container or calls a model; the commands live in ``runner.cli.project``.
"""
