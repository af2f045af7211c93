"""Drives idpool through a client that openapi-python-client generated from
the served document (the package idpool_client on PYTHONPATH): issue IDs,
accept a document with an Idempotency-Key, read it back, read gaps, and get a
problem+json error as the typed Problem. Exits non-zero on any surprise."""

import os
import sys
from http import HTTPStatus

from idpool_client import AuthenticatedClient
from idpool_client.api.documents import create_document, get_document
from idpool_client.api.gaps import list_gaps
from idpool_client.api.ids import issue_ids
from idpool_client.models import (
    AcceptedDocument,
    CreateDocument,
    DocumentView,
    GapList,
    IssuedIds,
    IssueIdsRequest,
    Metadata,
    Problem,
)


def check(condition: bool, what: str) -> None:
    if not condition:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


client = AuthenticatedClient(
    base_url=os.environ["IDPOOL_URL"], token=os.environ["IDPOOL_KEY"]
)

issued = issue_ids.sync_detailed(
    client=client, body=IssueIdsRequest(project="PYC", type_="1", count=3)
)
check(issued.status_code == HTTPStatus.OK, f"POST /api/v1/ids: {issued.status_code}")
check(isinstance(issued.parsed, IssuedIds), f"typed answer: {issued.parsed!r}")
ids = issued.parsed.ids
check(len(ids) == 3 and issued.parsed.seqs == sorted(issued.parsed.seqs), f"{ids}")

document = CreateDocument(
    project="PYC",
    type_="1",
    metadata=Metadata.from_dict({"title": "from Python", "rev": 2}),
)
accepted = create_document.sync_detailed(
    client=client, body=document, idempotency_key="py-doc-1"
)
check(accepted.status_code == HTTPStatus.ACCEPTED, f"POST /api/v1/documents: {accepted.status_code}")
check(isinstance(accepted.parsed, AcceptedDocument), f"typed answer: {accepted.parsed!r}")
again = create_document.sync_detailed(
    client=client, body=document, idempotency_key="py-doc-1"
)
check(
    again.parsed.id == accepted.parsed.id
    and again.headers.get("idempotent-replayed") == "true",
    "the retry with the same Idempotency-Key replays the first answer",
)

read = get_document.sync_detailed(id=accepted.parsed.id, client=client)
check(isinstance(read.parsed, DocumentView), f"read back: {read.parsed!r}")
check(read.parsed.id == accepted.parsed.id, "the same document")

gaps = list_gaps.sync_detailed(client=client, project="PYC", type_="1")
check(isinstance(gaps.parsed, GapList), f"gaps: {gaps.parsed!r}")

refused = issue_ids.sync_detailed(
    client=client, body=IssueIdsRequest(project="PYC", type_="1", count=0)
)
check(refused.status_code == HTTPStatus.BAD_REQUEST, f"count 0: {refused.status_code}")
check(
    isinstance(refused.parsed, Problem) and refused.parsed.code == "invalid_count",
    f"typed problem: {refused.parsed!r}",
)

print(f"python client: ok ({ids[0]}, {accepted.parsed.id})")
