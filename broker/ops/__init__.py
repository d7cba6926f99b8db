"""Operations: the supervisor (reaping, replays), failover, dead-letter replay, status and weight
updates."""
