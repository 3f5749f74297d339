"""The data stage: devices' records in Kafka → preprocessed snapshots in storage.

Kafka clients and the record contract (`kafka`, `kafka_config`, `records`, `broker`), producing
(`produce`, `synth`, `scenes`), preprocessing (`preprocess`), writing and reading snapshots
(`sink`, `snapshot`, `lease`), bulk ingest (`ingest`), continuous ingest (`watch`, `stream`) and
compaction (`compact`). Later stages read only what `snapshot` exposes.
"""
