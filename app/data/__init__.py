"""The data stage: devices' records in Kafka → the Iceberg table of behaviour images.

Kafka clients and the record contract (`kafka`, `probe`, `kafka_config`, `records`, `broker`),
producing (`produce`, `synth`, `scenes`, `desktop`), preprocessing (`preprocess`), the table
(`catalog`: where it lives and its schema; `table`: `ImageTable`, commits that carry the Kafka
offsets and pinned reads; `metadata`: what those commits and the table's properties record;
`maintenance`: compaction, expiry, orphans; `erasure`: one user out, for good), bulk ingest
(`ingest`, reading with `kafka_range`, planned by `plan`, written by `sink`, proven by `proof`),
continuous ingest (`watch`, `stream` with `partitions`, `parts`, `lag`), `redrive` of the dead
letters (`dead_letters`), and `migrate` from the old snapshot folders (`legacy`, which nothing
else reads). Later stages read the table through `selection` alone.
"""
