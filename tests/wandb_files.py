"""Read an offline wandb run's `.wandb` file: a LevelDB-style log of protobuf `Record`s, parsed
with wandb's own protobuf classes (wandb 0.19+ ships no Python reader for it)."""

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a wandb data file"
    pos, buf, records = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        buf += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
            buf = b""
    return records
