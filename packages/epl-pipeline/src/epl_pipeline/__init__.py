"""epl-pipeline: pipeline parallelism for EPL (first cut: schedules, stage proxies, one executor)."""
