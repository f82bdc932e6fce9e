"""spectune's tuner package. Kept import-free so `tuner.schema` stays light for engine and deploy."""
