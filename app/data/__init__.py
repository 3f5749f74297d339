"""The data stage: devices' records in Kafka → preprocessed snapshots in storage.

Kafka clients and the record contract (`kafka`, `kafka_config`, `records`, `broker`), producing
(`produce`, `synth`, `scenes`, `desktop`), preprocessing (`preprocess`), snapshots (`manifest`:
what a commit records and its proof; `snapshot`: `SnapshotStore`, committing and verified reads;
`integrity`; `sink`, `lease`), bulk ingest (`ingest`, reading with `kafka_range`, planned by
`plan`), continuous ingest (`watch`, `stream` with `partitions`, `parts`, `lag`) and compaction
(`compact`); the Iceberg table that replaces the snapshot folders (`catalog`, `table`, #25) and
`migrate` from them. Later stages read only what `manifest` and `snapshot` expose.
"""
