"""spectune's tuner package. Kept import-free so `tuner.schema.config` stays light for engine and deploy."""
