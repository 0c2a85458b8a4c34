"""The improvement cycle: freeze, stages, apply, compare, receipt (SPEC §1, §3, §5, §6, §10)."""
