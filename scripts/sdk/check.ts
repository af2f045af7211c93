// Drives idpool through types that openapi-typescript generated from the
// served document (target/sdk/ts/idpool.ts) and openapi-fetch: issue IDs,
// accept a document with an Idempotency-Key, read it back, read gaps, and
// get a problem+json error as the typed error. Exits non-zero on any
// surprise. Compiled with `tsc --strict`, so the types are checked too.
import createClient from "openapi-fetch";
import type { paths, components } from "./idpool.js";

type Problem = components["schemas"]["Problem"];

// What this script needs of Node's globals (no @types/node to install).
declare const process: {
  env: Record<string, string | undefined>;
  exit(code: number): never;
};

const baseUrl = process.env.IDPOOL_URL ?? "http://127.0.0.1:8080";
const key = process.env.IDPOOL_KEY ?? "";
const client = createClient<paths>({
  baseUrl,
  headers: { Authorization: `Bearer ${key}` },
});

function check(condition: boolean, what: string): void {
  if (!condition) {
    console.error(`FAILED: ${what}`);
    process.exit(1);
  }
}

const issued = await client.POST("/api/v1/ids", {
  body: { project: "TSC", type: "1", count: 3 },
});
check(issued.response.status === 200, `POST /api/v1/ids answered ${issued.response.status}`);
const ids: string[] = issued.data?.ids ?? [];
const seqs: number[] = issued.data?.seqs ?? [];
check(ids.length === 3 && seqs[0] < seqs[2], `three ascending IDs: ${ids}`);

const body = { project: "TSC", type: "1", metadata: { title: "from TypeScript" } };
const params = { header: { "Idempotency-Key": "ts-doc-1" } };
const accepted = await client.POST("/api/v1/documents", { params, body });
check(accepted.response.status === 202, `POST /api/v1/documents answered ${accepted.response.status}`);
const documentId: string = accepted.data?.id ?? "";
const again = await client.POST("/api/v1/documents", { params, body });
check(
  again.data?.id === documentId && again.response.headers.get("idempotent-replayed") === "true",
  "the retry with the same Idempotency-Key replays the first answer",
);

const read = await client.GET("/api/v1/documents/{id}", {
  params: { path: { id: documentId } },
});
check(read.data?.id === documentId, `read back ${documentId}`);
const status: string = read.data?.status ?? "";
check(["pending", "committed"].includes(status), `status ${status}`);

const gaps = await client.GET("/api/v1/ids/gaps", {
  params: { query: { project: "TSC", type: "1" } },
});
check(gaps.response.status === 200 && Array.isArray(gaps.data?.gaps), "gaps listed");

const refused = await client.POST("/api/v1/ids", {
  body: { project: "TSC", type: "1", count: 0 },
});
const problem: Problem | undefined = refused.error as Problem | undefined;
check(refused.response.status === 400, `count 0 answered ${refused.response.status}`);
check(problem?.code === "invalid_count" && problem.status === 400, `typed problem: ${JSON.stringify(problem)}`);

console.log(`typescript client: ok (${ids[0]}, ${documentId})`);
