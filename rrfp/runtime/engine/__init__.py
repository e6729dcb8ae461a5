"""The per-rank engine: inbox -> ready set -> arbiter -> executor -> outbox, the watchdog and step hooks."""
