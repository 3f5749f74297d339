"""The data stage: devices' records in Kafka → preprocessed snapshots in storage.

Kafka clients and the record contract (`kafka`, `kafka_config`, `records`, `broker`), producing
(`produce`, `synth`, `scenes`, `desktop`), preprocessing (`preprocess`), snapshots (`manifest`:
what a commit records and its proof; `snapshot`: `SnapshotStore`, committing and verified reads;
`integrity`; `sink`, `lease`), bulk ingest (`ingest`, reading with `kafka_range`, planned by
`plan`), continuous ingest (`watch`, `stream` with `partitions`, `parts`, `lag`) and compaction
(`compact`). Later stages read only what `manifest` and `snapshot` expose.
"""
