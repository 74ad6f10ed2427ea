"""Drives the official Python `qstash` SDK (3.4.0) against a running qstash-dev.

Env: QSTASH_URL, QSTASH_TOKEN, QSTASH_CURRENT_SIGNING_KEY, QSTASH_NEXT_SIGNING_KEY (set by
qstash-dev/tests/sdk_compat.rs). Exits non-zero on any failure.
"""

import json
import os
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from qstash import QStash, Receiver

warnings.simplefilter("ignore")  # PyJWT warns about HMAC keys shorter than 32 bytes

BASE = os.environ["QSTASH_URL"]
TOKEN = os.environ["QSTASH_TOKEN"]
receiver = Receiver(
    current_signing_key=os.environ["QSTASH_CURRENT_SIGNING_KEY"],
    next_signing_key=os.environ["QSTASH_NEXT_SIGNING_KEY"],
)

received = []
lock = threading.Lock()
sink_base = ""


class Sink(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def handle_any(self):
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n).decode("utf-8")
        url = sink_base + self.path
        error = None
        try:
            receiver.verify(signature=self.headers.get("upstash-signature"), body=body, url=url)
        except Exception as e:  # noqa: BLE001
            error = str(e)
        with lock:
            received.append(
                {"path": self.path.split("?")[0], "url": url, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body, "error": error}
            )
        status = 500 if self.path.startswith("/fail") else 200
        self.send_response(status)
        self.end_headers()
        self.wfile.write(b"ok" if status == 200 else b"failing on purpose")

    do_POST = handle_any
    do_PUT = handle_any
    do_GET = handle_any


httpd = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
sink_base = f"http://127.0.0.1:{httpd.server_address[1]}"
threading.Thread(target=httpd.serve_forever, daemon=True).start()


def wait_for(pred, what, n=1, timeout=20.0):
    end = time.time() + timeout
    while True:
        with lock:
            hits = [r for r in received if pred(r)]
        if len(hits) >= n:
            return hits
        if time.time() > end:
            raise AssertionError(f"timed out waiting for {what}: {[r['path'] for r in received]}")
        time.sleep(0.02)


def at(path):
    return lambda r: r["path"] == path


def verified(r):
    assert r["error"] is None, f"signature of {r['url']} did not verify: {r['error']}"


client = QStash(TOKEN, base_url=BASE)
checks = 0


def step(name):
    def deco(fn):
        global checks
        fn()
        checks += 1
        print(f"ok - {name}", flush=True)
        return fn

    return deco


@step("publish_json with delay, retries, dedup id, flow control, headers, callbacks")
def _():
    kwargs = dict(
        url=f"{sink_base}/py/one?x=1",
        body={"hello": "world"},
        delay="10s",
        retries=2,
        deduplication_id="py-dedup-1",
        content_based_deduplication=False,
        flow_control={"key": "py-tenant", "parallelism": 2, "rate": 50, "period": "1m"},
        headers={"X-Custom": "abc"},
        callback=f"{sink_base}/py/cb",
        callback_headers={"X-Cb": "1"},
        failure_callback=f"{sink_base}/py/fcb",
    )
    res = client.message.publish_json(**kwargs)
    assert res.message_id.startswith("msg_")
    dup = client.message.publish_json(**kwargs)
    assert dup.message_id == res.message_id
    assert dup.deduplicated is True
    d = wait_for(at("/py/one"), "delivery")[0]
    verified(d)
    assert json.loads(d["body"]) == {"hello": "world"}
    assert d["headers"].get("x-custom") == "abc"
    cb = wait_for(at("/py/cb"), "callback")[0]
    verified(cb)
    assert cb["headers"].get("x-cb") == "1"
    assert json.loads(cb["body"])["sourceMessageId"] == res.message_id
    fc = client.flow_control.get("py-tenant")
    assert fc.key == "py-tenant" and fc.parallelism_max == 2
    assert client.flow_control.get_global_parallelism().parallelism_max > 0
    try:
        receiver.verify(signature=d["headers"]["upstash-signature"], body=d["body"] + " ", url=d["url"])
        raise AssertionError("a tampered body verified")
    except Exception as e:  # noqa: BLE001
        assert "tampered" not in str(e)


@step("batch_json")
def _():
    res = client.message.batch_json(
        [
            {"url": f"{sink_base}/py/batch", "body": {"i": 1}},
            {"url": f"{sink_base}/py/batch", "body": {"i": 2}, "headers": {"X-I": "2"}},
        ]
    )
    assert len(res) == 2
    hits = wait_for(at("/py/batch"), "batch deliveries", n=2)
    for h in hits:
        verified(h)
    assert sorted(json.loads(h["body"])["i"] for h in hits) == [1, 2]


@step("queues: upsert/get/list/pause/enqueue_json/resume/delete")
def _():
    client.queue.upsert("py-queue", parallelism=1, paused=True)
    q = client.queue.get("py-queue")
    assert q.name == "py-queue" and q.parallelism == 1 and q.paused is True
    assert any(x.name == "py-queue" for x in client.queue.list())
    res = client.message.enqueue_json(queue="py-queue", url=f"{sink_base}/py/queued", body={"q": 1})
    assert res.message_id.startswith("msg_")
    time.sleep(0.3)
    assert not [r for r in received if r["path"] == "/py/queued"], "paused queue delivered"
    client.queue.resume("py-queue")
    verified(wait_for(at("/py/queued"), "queued delivery")[0])
    client.queue.pause("py-queue")
    assert client.queue.get("py-queue").paused is True
    client.queue.delete("py-queue")
    try:
        client.queue.get("py-queue")
        raise AssertionError("deleted queue still found")
    except AssertionError:
        raise
    except Exception:  # noqa: BLE001
        pass


@step("message.get / message.cancel")
def _():
    res = client.message.publish_json(url=f"{sink_base}/py/never", body={"x": 1}, delay="1d")
    m = client.message.get(res.message_id)
    assert m.message_id == res.message_id and m.url == f"{sink_base}/py/never"
    assert m.body == '{"x": 1}'
    client.message.cancel(res.message_id)
    try:
        client.message.get(res.message_id)
        raise AssertionError("cancelled message still found")
    except AssertionError:
        raise
    except Exception:  # noqa: BLE001
        pass
    res2 = client.message.publish_json(url=f"{sink_base}/py/never", body={"x": 2}, delay="1d")
    assert client.message.cancel_many([res2.message_id]) == 1


@step("dlq.list / dlq.get / dlq.delete / dlq.delete_many")
def _():
    ids = []
    for i in range(2):
        ids.append(client.message.publish_json(url=f"{sink_base}/fail/py", body={"f": i}, retries=0).message_id)
    end = time.time() + 20
    while True:
        entries = [m for m in client.dlq.list().messages if m.message_id in ids]
        if len(entries) == 2:
            break
        assert time.time() < end, "messages did not reach the DLQ"
        time.sleep(0.02)
    e = client.dlq.get(entries[0].dlq_id)
    assert e.message_id == entries[0].message_id and e.response_status == 500
    # What the outbox's reconciler asks (decision 0015): one message's DLQ entry by its id, and pages by cursor.
    by_id = client.dlq.list(filter={"message_id": ids[1]})
    assert [m.message_id for m in by_id.messages] == [ids[1]] and not by_id.cursor
    page = client.dlq.list(count=1)
    assert len(page.messages) == 1 and page.cursor
    rest = client.dlq.list(cursor=page.cursor, count=100)
    assert page.messages[0].dlq_id not in [m.dlq_id for m in rest.messages]
    client.dlq.delete(entries[0].dlq_id)
    assert client.dlq.delete_many([entries[1].dlq_id]) == 1
    assert not [m for m in client.dlq.list().messages if m.message_id in ids]


print(f"python sdk compat: {checks} passed, 0 failed")
httpd.shutdown()
