// An outboxpg worker in Node.js, on the SQL API alone (docs/how-to/other-language.md).
//
//   npm ci && DATABASE_URL=postgresql://relay@db/shop node worker.js
//
// It drains the outbox and exits: claim a batch, publish it, report it, until a claim comes back
// empty (--follow: poll once a second instead of exiting). The publisher is a stand-in that prints
// one JSON line per event; put your broker or HTTP call in publish(). An event whose payload holds
// "fail": true fails, to show what a worker reports for a partly failed run.
//
// The rules it keeps, and the pitfalls it avoids:
// - ids are bigint: node-postgres returns int8 as a string unless told otherwise; here they
//   are parsed into BigInt (never Number: ids above 2^53 would silently change);
// - payload arrives parsed when selected as jsonb: select payload::text for the stored bytes;
// - one claim = one lease token: every row of a claim carries the same lease_token, and every
//   report of those rows names it;
// - order per aggregate: an aggregate's rows come in id order (a "run"); publish them one after
//   another, each only once the previous one is delivered, and stop at the first failure. Then
//   complete the published prefix, fail the first failure, release the rest (not attempted: no
//   attempt counted); they come back after the failed one, in order. Runs of different
//   aggregates may be published concurrently;
// - outbox_fail returns NULL (and outbox_complete / outbox_release a lower count) when the lease
//   was lost: the lease expired and another worker claimed the events. Nothing was changed;
//   the other worker publishes them again (the broker's dedup by msg_id drops the duplicate).
"use strict";

const pg = require("pg");

// int8 (OID 20) as BigInt instead of a string. outbox ids are bigint.
pg.types.setTypeParser(20, (text) => BigInt(text));

const BATCH_SIZE = Number(process.env.BATCH_SIZE || 100);
const LEASE = process.env.LEASE || "30 seconds";            // an interval; NULL would mean default_lease
const WORKER = process.env.WORKER_NAME || `node-example:${process.pid}`;
const PUBLISH_DELAY_MS = Number(process.env.PUBLISH_DELAY_MS || 0);   // a slow publisher, for trying out leases

function log(obj) {
  // BigInt has no JSON form of its own: ids are printed as strings.
  console.log(JSON.stringify(obj, (_k, v) => (typeof v === "bigint" ? v.toString() : v)));
}

// The stand-in publisher: resolve = delivered, throw = failed. A real one sends event.payload (the
// stored JSON text, as bytes) to event.subject with event.msg_id as its idempotency key (NATS:
// the Nats-Msg-Id header; HTTP: an Idempotency-Key header), and resolves once the broker said stored.
async function publish(event) {
  if (PUBLISH_DELAY_MS) await new Promise((resolve) => setTimeout(resolve, PUBLISH_DELAY_MS));
  if (JSON.parse(event.payload).fail === true) {
    throw new Error(`stand-in broker refused event ${event.id}`);
  }
  log({ published: event.id, subject: event.subject, msg_id: event.msg_id, payload: event.payload });
}

// The claim runs in its own short transaction (autocommit): the lease starts now, and no
// transaction stays open while publishing.
const CLAIM = `
  SELECT id, subject, aggregate_type, aggregate_id, event_type,
         payload::text AS payload,      -- the stored JSON text; selected as jsonb it would arrive parsed
         headers, msg_id, attempts, lease_token, created_at
    FROM outbox_claim($1, $2::interval, $3)`;

// Publish one run (one aggregate's rows, in id order): one after another, stop at the first
// failure. Returns { published: [ids], failed: {id, error} | null, rest: [ids] }.
async function publishRun(run) {
  const published = [];
  for (let i = 0; i < run.length; i++) {
    try {
      await publish(run[i]);
      published.push(run[i].id);
    } catch (err) {
      return { published, failed: { id: run[i].id, error: String(err && err.message || err) },
               rest: run.slice(i + 1).map((e) => e.id) };
    }
  }
  return { published, failed: null, rest: [] };
}

async function handleBatch(client, rows) {
  const token = rows[0].lease_token;
  if (!rows.every((r) => r.lease_token === token)) throw new Error("one claim, one lease token");

  // Group into runs by aggregate, keeping the claim's order (ids ascending within each).
  const runs = new Map();
  for (const row of rows) {
    const key = `${row.aggregate_type}\u0000${row.aggregate_id}`;
    if (!runs.has(key)) runs.set(key, []);
    runs.get(key).push(row);
  }
  // Different aggregates concurrently; within one, strictly one after another.
  const outcomes = await Promise.all([...runs.values()].map(publishRun));

  const published = outcomes.flatMap((o) => o.published);
  if (published.length) {
    // Their created_at range (a Date keeps milliseconds, enough): the report reads only their partitions.
    const created = rows.filter((r) => published.includes(r.id)).map((r) => r.created_at.getTime());
    const { rows: [{ n }] } = await client.query("SELECT outbox_complete($1::bigint[], $2, $3, $4) AS n",
      [published, token, new Date(Math.min(...created)), new Date(Math.max(...created))]);
    if (n !== published.length) {
      log({ lease_lost: true, note: `completed ${n} of ${published.length}: the rest were claimed by another worker` });
    }
  }
  for (const o of outcomes.filter((o) => o.failed)) {
    const { rows: [{ state }] } = await client.query(
      "SELECT outbox_fail($1, $2, $3) AS state", [o.failed.id, token, o.failed.error]);
    if (state === null) {
      // The lease was lost: nothing changed, and the rest of the run is not ours to release.
      log({ lease_lost: true, id: o.failed.id, note: "outbox_fail returned NULL: another worker holds the event now" });
      continue;
    }
    log({ failed: o.failed.id, state, error: o.failed.error });   // 'pending' (retried after a backoff) or 'dead'
    if (o.rest.length) {
      const { rows: [{ n }] } = await client.query("SELECT outbox_release($1::bigint[], $2) AS n", [o.rest, token]);
      log({ released: o.rest, count: n });
    }
  }
}

async function main() {
  const follow = process.argv.includes("--follow");
  // DATABASE_URL, or libpq's PGHOST, PGDATABASE, PGUSER, PGPASSWORD... when unset.
  const client = new pg.Client({ connectionString: process.env.DATABASE_URL, application_name: WORKER });
  await client.connect();
  let stopping = false;
  process.on("SIGTERM", () => { stopping = true; });
  process.on("SIGINT", () => { stopping = true; });
  try {
    while (!stopping) {
      const { rows } = await client.query(CLAIM, [BATCH_SIZE, LEASE, WORKER]);
      if (rows.length) {
        log({ claimed: rows.map((r) => r.id), lease_token: rows[0].lease_token });
        await handleBatch(client, rows);
      } else if (follow) {
        await new Promise((resolve) => setTimeout(resolve, 1000));   // or LISTEN outbox: docs/explanation/wakeup.md
      } else {
        break;
      }
    }
  } finally {
    await client.end();
  }
}

main().catch((err) => {
  console.error(`worker.js: ${err.message}`);
  process.exit(1);
});
