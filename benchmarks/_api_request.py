"""One request to memfit ui's JSON API, in this process (Starlette's TestClient), answered as a
command answers: for benchmarks/bad_inputs.py's table.

    python benchmarks/_api_request.py GET '/api/plan?model=smollm2-135m&context_bytes=-1'
    python benchmarks/_api_request.py POST '/api/model?filename=config.json' BODY_FILE

A 2xx prints the answer's first line and exits 0; a 4xx prints ``error: <the answer's error>`` on
stderr and exits 2; a 500 prints the server's traceback and exits 1 (a bug). The server is the
page's, without its worker processes: plans are made here, one after the other.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from starlette.testclient import TestClient

    from memfit.ui.app import create_app
    from memfit.ui.service import PlannerService

    method, url, *body = argv
    service = PlannerService()
    service.mark_warm()  # no background imports: the request imports what it needs
    # raise_server_exceptions: a 500 ends this process with the server's traceback.
    with TestClient(create_app(service)) as client:
        answer = client.request(method, url, content=Path(body[0]).read_bytes() if body else None)
    if 400 <= answer.status_code < 500:
        print(f"error: {answer.json()['error']}", file=sys.stderr)
        return 2
    print(answer.text.splitlines()[0] if answer.text else answer.status_code)
    return 0 if answer.status_code < 400 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
