"""ops/nats/catalogue.json mirrors the streams and consumers declared in bus/subjects.py."""
import json
from pathlib import Path

from bus.subjects import CONSUMERS, STREAMS, catalogue

ROOT = Path(__file__).resolve().parents[1]


def test_ops_catalogue_matches_code():
    on_disk = json.loads((ROOT / "ops" / "nats" / "catalogue.json").read_text())
    assert on_disk == json.loads(json.dumps(catalogue("RUN"))), "regenerate: python -m bus.subjects > ops/nats/catalogue.json"
    assert len(on_disk["streams"]) == len(STREAMS) and len(on_disk["consumers"]) == len(CONSUMERS)
