// Drives the official @upstash/qstash SDK (pinned in package.json) against a running qstash-dev.
// Env: QSTASH_URL, QSTASH_TOKEN, QSTASH_CURRENT_SIGNING_KEY, QSTASH_NEXT_SIGNING_KEY (set by
// qstash-dev/tests/sdk_compat.rs). QSTASH_DEV is deliberately not used. Exits non-zero on any failure.
import http from "node:http";
import assert from "node:assert/strict";
import { Client, Receiver } from "@upstash/qstash";

const baseUrl = process.env.QSTASH_URL;
const token = process.env.QSTASH_TOKEN;
assert.ok(baseUrl && token, "QSTASH_URL and QSTASH_TOKEN must be set");
assert.ok(!process.env.QSTASH_DEV, "QSTASH_DEV must not be set");

const receiver = new Receiver({
  currentSigningKey: process.env.QSTASH_CURRENT_SIGNING_KEY,
  nextSigningKey: process.env.QSTASH_NEXT_SIGNING_KEY,
});

// ---- an endpoint that records and verifies every delivery -------------------------------------------------
const received = [];
const inFlight = {};
const maxInFlight = {};
let sinkBase = "";
const sink = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", async () => {
    const body = Buffer.concat(chunks).toString("utf8");
    const url = `${sinkBase}${req.url}`;
    let verified = false;
    let error = null;
    try {
      verified = await receiver.verify({ signature: req.headers["upstash-signature"], body, url });
    } catch (e) {
      error = String(e?.message ?? e);
    }
    const path = req.url.split("?")[0];
    received.push({ path, url, headers: req.headers, body, verified, error, at: performance.now() });
    if (path.startsWith("/js/slow/")) {
      // Held for a while, so that deliveries a flow-control key allows at once overlap here.
      const key = path.slice("/js/slow/".length);
      inFlight[key] = (inFlight[key] ?? 0) + 1;
      maxInFlight[key] = Math.max(maxInFlight[key] ?? 0, inFlight[key]);
      await new Promise((r) => setTimeout(r, 150));
      inFlight[key] -= 1;
    }
    res.statusCode = req.url.startsWith("/fail") ? 500 : 200;
    res.end(res.statusCode === 200 ? "ok" : "failing on purpose");
  });
});
await new Promise((resolve) => sink.listen(0, "127.0.0.1", resolve));
sinkBase = `http://127.0.0.1:${sink.address().port}`;

async function waitFor(pred, what, ms = 20000) {
  const end = Date.now() + ms;
  for (;;) {
    const hits = received.filter(pred);
    if (hits.length > 0) return hits;
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}; received: ${JSON.stringify(received.map((r) => r.path))}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const at = (path) => (r) => r.path === path;
function assertVerified(r) {
  assert.equal(r.error, null, `signature of ${r.url} did not verify: ${r.error}`);
  assert.equal(r.verified, true);
}

const client = new Client({ baseUrl, token });
let checks = 0;
async function step(name, fn) {
  await fn();
  checks += 1;
  console.log(`ok - ${name}`);
}

await step("publishJSON with delay, retries, dedup id, flow control, headers, callbacks", async () => {
  const opts = {
    url: `${sinkBase}/js/one?x=1`,
    body: { hello: "world", n: 1 },
    delay: 10,
    retries: 2,
    deduplicationId: "js-dedup-1",
    flowControl: { key: "js-tenant", parallelism: 2, rate: 100, period: "1m" },
    headers: { "X-Custom": "abc" },
    callback: `${sinkBase}/js/cb`,
    failureCallback: `${sinkBase}/js/fcb`,
    label: "js-label",
  };
  const res = await client.publishJSON(opts);
  assert.match(res.messageId, /^msg_/);
  const dup = await client.publishJSON(opts);
  assert.equal(dup.messageId, res.messageId);
  assert.equal(dup.deduplicated, true);
  const [d] = await waitFor(at("/js/one"), "delivery of publishJSON");
  assertVerified(d);
  assert.equal(d.url, `${sinkBase}/js/one?x=1`);
  assert.deepEqual(JSON.parse(d.body), { hello: "world", n: 1 });
  assert.equal(d.headers["x-custom"], "abc");
  assert.equal(d.headers["upstash-message-id"], res.messageId);
  assert.equal(d.headers["content-type"], "application/json");
  const [cb] = await waitFor(at("/js/cb"), "callback");
  assertVerified(cb);
  const cbBody = JSON.parse(cb.body);
  assert.equal(cbBody.status, 200);
  assert.equal(cbBody.sourceMessageId, res.messageId);
  assert.equal(Buffer.from(cbBody.body, "base64").toString(), "ok");
  const fc = await client.flowControl.get("js-tenant");
  assert.equal(fc.flowControlKey, "js-tenant");
  assert.equal(typeof fc.waitListSize, "number");
  assert.equal(fc.parallelismMax, 2);
  // A tampered body must not verify: proves the verification above is real.
  await assert.rejects(receiver.verify({ signature: d.headers["upstash-signature"], body: d.body + " ", url: d.url }));
});

await step("flow control per key: parallelism and rate as the SDK sets them", async () => {
  // Two keys of one tenant each, as the outbox relay publishes with RELAY_TENANT_LIMITS: parallelism 1 and 3.
  const publish = (key, parallelism, n) =>
    Promise.all(
      Array.from({ length: n }, (_, i) =>
        client.publishJSON({ url: `${sinkBase}/js/slow/${key}`, body: { i }, flowControl: { key, parallelism } }),
      ),
    );
  await Promise.all([publish("js-one", 1, 4), publish("js-three", 3, 6)]);
  await waitFor(() => received.filter(at("/js/slow/js-one")).length >= 4 && received.filter(at("/js/slow/js-three")).length >= 6, "slow deliveries");
  await sleep(200);
  assert.equal(maxInFlight["js-one"], 1, "parallelism=1 let deliveries overlap");
  assert.equal(maxInFlight["js-three"], 3, "parallelism=3 did not run 3 at once");
  // Rate 2 per period: five deliveries need three windows, so the first and the fifth start at least one whole
  // window apart (this server runs at time_scale 0.001: a window of 1m is 60 ms).
  const rated = await Promise.all(
    Array.from({ length: 5 }, (_, i) =>
      client.publishJSON({ url: `${sinkBase}/js/rated`, body: { i }, flowControl: { key: "js-rated", rate: 2, period: "1m" } }),
    ),
  );
  assert.equal(rated.length, 5);
  await waitFor(() => received.filter(at("/js/rated")).length >= 5, "rated deliveries");
  const times = received.filter(at("/js/rated")).map((r) => r.at).sort((a, b) => a - b);
  assert.ok(times[4] - times[0] >= 55, `5 deliveries at rate 2 per 60 ms window took only ${times[4] - times[0]} ms`);
  const fc = await client.flowControl.get("js-rated");
  assert.equal(fc.rateMax, 2);
  assert.equal(fc.ratePeriod, 60);
});

await step("batchJSON", async () => {
  const res = await client.batchJSON([
    { url: `${sinkBase}/js/batch`, body: { i: 1 } },
    { url: `${sinkBase}/js/batch`, body: { i: 2 }, headers: { "X-I": "2" } },
    { url: `${sinkBase}/js/batch`, body: { i: 3 }, retries: 0, deduplicationId: "js-b-3" },
  ]);
  assert.equal(res.length, 3);
  for (const r of res) assert.match(r.messageId, /^msg_/);
  const hits = await waitFor((r) => r.path === "/js/batch" && received.filter(at("/js/batch")).length >= 3, "3 batch deliveries");
  const bodies = hits.map((h) => JSON.parse(h.body).i).sort();
  assert.deepEqual(bodies, [1, 2, 3]);
  hits.forEach(assertVerified);
  assert.equal(hits.find((h) => JSON.parse(h.body).i === 2).headers["x-i"], "2");
});

await step("queues: upsert/get/list/pause/enqueueJSON/resume/delete", async () => {
  const q = client.queue({ queueName: "js-queue" });
  await q.upsert({ parallelism: 1 });
  let info = await q.get();
  assert.equal(info.name, "js-queue");
  assert.equal(info.parallelism, 1);
  assert.equal(info.paused, false);
  const all = await client.queue().list();
  assert.ok(all.some((x) => x.name === "js-queue"));
  await q.pause();
  info = await q.get();
  assert.equal(info.paused, true);
  const res = await q.enqueueJSON({ url: `${sinkBase}/js/queued`, body: { q: 1 } });
  assert.match(res.messageId, /^msg_/);
  await sleep(300);
  assert.equal(received.filter(at("/js/queued")).length, 0, "paused queue must not deliver");
  await q.resume();
  const [d] = await waitFor(at("/js/queued"), "queued delivery");
  assertVerified(d);
  await q.delete();
  await assert.rejects(q.get());
});

await step("messages.get / messages.cancel", async () => {
  const res = await client.publishJSON({ url: `${sinkBase}/js/never`, body: { x: 1 }, delay: "1d" });
  const m = await client.messages.get(res.messageId);
  assert.equal(m.messageId, res.messageId);
  assert.equal(m.url, `${sinkBase}/js/never`);
  assert.equal(m.body, '{"x":1}');
  const c = await client.messages.cancel(res.messageId);
  assert.equal(c.cancelled, 1);
  await assert.rejects(client.messages.get(res.messageId));
});

await step("dlq.listMessages / dlq.retry / dlq.delete and the failure callback", async () => {
  const res = await client.publishJSON({
    url: `${sinkBase}/fail/js`,
    body: { f: 1 },
    retries: 0,
    failureCallback: `${sinkBase}/js/failed`,
  });
  const [fcb] = await waitFor(at("/js/failed"), "failure callback");
  assertVerified(fcb);
  const fb = JSON.parse(fcb.body);
  assert.equal(fb.status, 500);
  assert.equal(fb.sourceMessageId, res.messageId);
  assert.ok(fb.dlqId);
  let list = await client.dlq.listMessages();
  const entry = list.messages.find((m) => m.messageId === res.messageId);
  assert.ok(entry, "failed message is in the DLQ");
  assert.equal(entry.dlqId, fb.dlqId);
  assert.equal(entry.responseStatus, 500);
  // What the outbox's reconciler asks (decision 0015): the DLQ entry of one message, by its id.
  const byId = await client.dlq.listMessages({ filter: { messageId: res.messageId } });
  assert.equal(byId.messages.length, 1);
  assert.equal(byId.messages[0].dlqId, fb.dlqId);
  assert.equal(byId.cursor, undefined);
  const none = await client.dlq.listMessages({ filter: { messageId: "msg_unknown" } });
  assert.equal(none.messages.length, 0);
  const retried = await client.dlq.retry(entry.dlqId);
  assert.equal(retried.responses.length, 1);
  assert.match(retried.responses[0].messageId, /^msg_/);
  await waitFor((r) => r.path === "/fail/js" && r.headers["upstash-message-id"] === retried.responses[0].messageId, "retried delivery");
  // The retry fails again and lands in the DLQ as a new entry; delete it.
  let again;
  for (let i = 0; i < 200 && !again; i++) {
    list = await client.dlq.listMessages();
    again = list.messages.find((m) => m.messageId === retried.responses[0].messageId);
    if (!again) await sleep(20);
  }
  assert.ok(again, "retried message failed into the DLQ again");
  const del = await client.dlq.delete(again.dlqId);
  assert.equal(del.deleted, 1);
  await assert.rejects(client.dlq.delete(again.dlqId));
});

console.log(`js sdk compat: ${checks} passed, 0 failed`);
sink.close();
process.exit(0);
