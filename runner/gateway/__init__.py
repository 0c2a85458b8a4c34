"""The host-side model gateway (SPEC §4).

Role containers have no network; every model call goes through a unix socket the
controller mounts into the container. The gateway holds the real credentials,
checks the per-role token, the model allowlist and the budget, forwards to the
role's upstream, and records the exact request and response bytes.
"""
