// The one tool every variant offers its model, and what the run saw.
import * as fs from "node:fs";
import { readFileSync } from "node:fs";

export const READ: string[] = [];
export const CALLS: { name: string; arguments: Record<string, unknown> }[] = [];
export const TOOL_NAME = "read_log";
export const TOOL_DESCRIPTION = "Return the latest log excerpt of one service.";
export const PARAMETERS = {
  type: "object",
  properties: { service: { type: "string", description: "the service's name" } },
  required: ["service"],
  additionalProperties: false,
} as const;

export function readLog(service: string): string {
  CALLS.push({ name: TOOL_NAME, arguments: { service } });
  const services: Record<string, string> = JSON.parse(readFileSync("/data/logs.json", "utf8")).services;
  if (!(service in services)) {
    return `no log for service ${JSON.stringify(service)}; known: ${Object.keys(services).sort().join(", ")}`;
  }
  READ.push(service);
  return services[service];
}

/** Run a tool call the model asked for (arguments as JSON text or an object). */
export function callTool(name: string, args: string | Record<string, unknown>): string {
  const parsed = typeof args === "string" ? JSON.parse(args || "{}") : args;
  if (name !== TOOL_NAME || typeof parsed !== "object" || parsed === null) return `unknown tool ${name}`;
  return readLog(String(parsed.service ?? ""));
}

export type Variant = (question: string, system: string, model: string) => Promise<string>;

/** Test-only (the e2e canary check, when the case asks for it): look for the host's
 * canary key in this process's environment, every process's environ and the files this
 * container can read (all of them with "full"; else the mounted and writable places, as
 * a full walk costs seconds); the result goes to /out/canary-scan.json. */
export function canaryScan(mode: string): void {
  const marker = Buffer.from(["cbx", "canary"].join(""));  // not foldable by esbuild
  const hits: string[] = [];
  for (const [k, v] of Object.entries(process.env)) if ((k + v).includes(marker.toString())) hits.push(`env:${k}`);
  for (const pid of fs.readdirSync("/proc").filter((p: string) => /^\d+$/.test(p))) {
    try { if (fs.readFileSync(`/proc/${pid}/environ`).includes(marker)) hits.push(`environ:${pid}`); } catch { /* gone */ }
  }
  let scanned = 0;
  const walk = (dir: string): void => {
    let names: string[];
    try { names = fs.readdirSync(dir); } catch { return; }
    for (const name of names) {
      const p = dir === "/" ? `/${name}` : `${dir}/${name}`;
      if (dir === "/" && ["proc", "sys", "dev"].includes(name)) continue;
      let st;
      try { st = fs.lstatSync(p); } catch { continue; }
      if (st.isDirectory()) walk(p);
      else if (st.isFile() && st.size <= 64 << 20) {
        try { if (fs.readFileSync(p).includes(marker)) hits.push(`file:${p}`); scanned++; } catch { /* unreadable */ }
      }
    }
  };
  const tops = mode === "full" ? ["/"] : ["/run", "/src", "/case", "/data", "/tmp", "/out", "/etc", "/root", "/home"];
  for (const top of tops) walk(top);
  // only what a replay sees alike: the count of files read varies with /tmp
  fs.writeFileSync("/out/canary-scan.json", JSON.stringify({ hits, mode, read_over_1000: scanned > 1000 }));
}
