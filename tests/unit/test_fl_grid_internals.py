"""The Flower internals `app/fl/grid.py` relies on, pinned without Ray or a broker: a Flower
upgrade that moves any of them fails here, saying what grid.py needs, instead of mid-round."""

from __future__ import annotations

import inspect
import pickle

import flwr
from flwr.app import Context, Error, Message, MetricRecord, RecordDict, UserConfig
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY, ErrorCode
from flwr.serverapp import Grid

from app.fl.grid import RayGrid, assign_message_id, stamp_task_identity

UPGRADE = f"flwr {flwr.__version__}: app/fl/grid.py needs"


def test_task_identity_stamps_the_messages_flower_creates():
    from flwr.supercore.task_identity import TaskIdentity

    stamp_task_identity(run_id=7, node_id=0, task_id=3)
    try:
        assert (TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id) == (7, 0, 3), (
            f"{UPGRADE} settable TaskIdentity.run_id/node_id/task_id"
        )
        # Flower's strategies build instruction messages like this, from the task's identity.
        message = Message(content=RecordDict(), dst_node_id=4, message_type="train")
        metadata = message.metadata
        stamped = metadata.run_id, metadata.src_node_id, metadata.src_task_id, metadata.dst_node_id
        assert stamped == (7, 0, 3, 4), f"{UPGRADE} Message metadata taken from TaskIdentity"
    finally:
        stamp_task_identity()  # what federate and tests/test_fl.py set
    assert Message(RecordDict(), 1, "train").metadata.run_id == 1


def test_message_ids_are_set_through_metadata_dict():
    stamp_task_identity()
    message = Message(RecordDict(), 2, "train")
    assert "_message_id" in message.metadata.__dict__, f"{UPGRADE} Metadata.__dict__['_message_id']"
    assign_message_id(message, "m-1")
    assert message.metadata.message_id == "m-1", (
        f"{UPGRADE} Metadata.message_id to read __dict__['_message_id']"
    )
    reply = Message(RecordDict({"metrics": MetricRecord({"x": 1})}), reply_to=message)
    assert reply.metadata.reply_to_message_id == "m-1"
    assert (reply.metadata.src_node_id, reply.metadata.dst_node_id) == (2, 0)
    assign_message_id(reply, "r-1")
    assert (reply.metadata.message_id, message.metadata.message_id) == ("r-1", "m-1")


def test_an_actor_rebuilds_the_message_from_pickled_metadata():
    stamp_task_identity()
    message = Message(RecordDict(), 3, "evaluate")
    assign_message_id(message, "m-3")
    metadata = pickle.loads(pickle.dumps(message.metadata))  # Ray ships metadata and content apart
    rebuilt = Message(content=RecordDict(), metadata=metadata)
    assert (rebuilt.metadata.message_id, rebuilt.metadata.message_type) == ("m-3", "evaluate"), (
        f"{UPGRADE} Message(content=..., metadata=...) and picklable Metadata"
    )


def test_error_replies_and_node_config_keys():
    stamp_task_identity()
    message = Message(RecordDict(), 1, "train")
    for code in (ErrorCode.CLIENT_APP_CRASHED, ErrorCode.CLIENT_APP_RAISED_EXCEPTION):
        reply = Message(Error(code=code, reason="x"), reply_to=message)
        assert reply.has_error() and reply.error.code == code
    # The ClientApp (and tests' echo app) read these literal keys from the node config.
    assert (PARTITION_ID_KEY, NUM_PARTITIONS_KEY) == ("partition-id", "num-partitions")
    node_config = UserConfig({PARTITION_ID_KEY: 0, NUM_PARTITIONS_KEY: 2})
    context = Context(
        run_id=0, node_id=1, node_config=node_config, state=RecordDict(), run_config=UserConfig()
    )
    assert context.node_config[PARTITION_ID_KEY] == 0


def test_run_create_empty_gives_the_grid_a_run():
    from flwr.supercore.run import Run

    assert Run.create_empty(5).run_id == 5, f"{UPGRADE} flwr.supercore.run.Run.create_empty(run_id)"


def test_ray_grid_implements_every_abstract_method_of_flowers_grid():
    missing = sorted(name for name in Grid.__abstractmethods__ if name not in vars(RayGrid))
    assert not missing and not inspect.isabstract(RayGrid), f"{UPGRADE} to implement Grid.{missing}"


def test_replies_cross_as_protobuf_and_keep_the_routing_of_their_instruction():
    import numpy as np
    from flwr.app import Array, ArrayRecord

    from app.fl.grid import _parse_reply, message_to_proto

    stamp_task_identity()
    instruction = Message(RecordDict(), 2, "train")
    assign_message_id(instruction, "m-2")
    other = Message(RecordDict(), 5, "train")
    assign_message_id(other, "m-5")
    # A client that answers in another's name: its reply claims node 5's instruction.
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.ones((2, 2), np.float32))})})
    claimed = Message(content, reply_to=other)
    reply = _parse_reply(message_to_proto(claimed).SerializeToString(), instruction)
    assert (reply.metadata.src_node_id, reply.metadata.reply_to_message_id) == (2, "m-2")
    assert np.array_equal(reply.content["arrays"]["w"].numpy(), np.ones((2, 2), np.float32))

    error = _parse_reply(
        message_to_proto(Message(Error(0, "boom"), reply_to=instruction)).SerializeToString(), instruction
    )
    assert error.has_error() and error.error.reason == "boom"
    garbage = _parse_reply(b"\xff" * 40, instruction)
    assert garbage.has_error() and "unreadable reply" in garbage.error.reason
    assert garbage.error.code == ErrorCode.CLIENT_APP_CRASHED
