"""Step features that plug into the engine's seams: auto, backfilling's started notices."""
