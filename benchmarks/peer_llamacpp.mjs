// llama.cpp's side of benchmarks/peer_llamacpp.py, through node-llama-cpp's prebuilt CPU build.
//
//     node benchmarks/peer_llamacpp.mjs PACKAGE_DIR MODEL_PATH THREADS PREFILL_CONTEXT SEQUENCES
//
// PACKAGE_DIR holds node_modules/node-llama-cpp (installed by peer_llamacpp.py). The driver
// loads MODEL_PATH once, with two contexts: one sequence of PREFILL_CONTEXT tokens for the
// prefill, and SEQUENCES sequences of DECODE_CONTEXT tokens each for decoding, batched by
// node-llama-cpp into one llama_decode per step. Then it answers one JSON request per line of
// stdin with one JSON line on stdout (llama.cpp's own log lines go to stderr):
//
//   {"op": "prefill", "tokens": [ids]}
//       -> {"seconds": s, "token": id}: the ids evaluated and the first token drawn greedily.
//   {"op": "decode", "prompts": [[ids], ...], "new_tokens": n}
//       -> {"seconds": s, "tokens": [[ids], ...]}: n greedy tokens per prompt, all prompts at
//          once, one sequence each; end-of-generation tokens are kept and decoding goes on.
//
// The first line it writes, before any request, describes what it loaded ({"ready": true,
// "llama_cpp": release, "cpu_variant": the ggml CPU library mapped, ...}). Each request
// starts from empty sequences. Any failure is one {"error": "..."} line, and the driver exits.

import { readFileSync } from "node:fs";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { pathToFileURL } from "node:url";

const DECODE_CONTEXT = 512; // tokens per decoding sequence: a short prompt and its new tokens

const [packageDir, modelPath, threadsArg, prefillContextArg, sequencesArg] = process.argv.slice(2);
const threads = Number(threadsArg);
const reply = (value) => process.stdout.write(`${JSON.stringify(value)}\n`);

// What the process mapped of ggml's CPU libraries: the prebuilt package ships one per CPU
// family (haswell, zen4, ...) and ggml loads the best one this CPU runs.
function cpuVariants() {
  const maps = readFileSync("/proc/self/maps", "utf8");
  const names = maps.match(/libggml-cpu-[\w.-]+\.so/g) ?? [];
  return [...new Set(names)];
}

async function start() {
  const entry = join(packageDir, "node_modules", "node-llama-cpp", "dist", "index.js");
  const { getLlama } = await import(pathToFileURL(entry).href);
  const version = JSON.parse(
    readFileSync(join(packageDir, "node_modules", "node-llama-cpp", "package.json"), "utf8"),
  ).version;
  const llama = await getLlama({
    gpu: false,
    build: "never",
    maxThreads: threads,
    logLevel: "warn",
    logger: (level, message) => process.stderr.write(`llama.cpp ${level}: ${message}\n`),
  });
  const started = performance.now();
  const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
  const loadSeconds = (performance.now() - started) / 1e3;
  const threadOption = { ideal: threads, min: threads };
  const prefill = await model.createContext({
    contextSize: Number(prefillContextArg),
    sequences: 1,
    threads: threadOption,
  });
  const decode = await model.createContext({
    contextSize: DECODE_CONTEXT,
    sequences: Number(sequencesArg),
    threads: threadOption,
  });
  const decodeSequences = [];
  for (let i = 0; i < decode.totalSequences; i++) decodeSequences.push(decode.getSequence());
  reply({
    ready: true,
    node_llama_cpp: version,
    llama_cpp: llama.llamaCppRelease,
    build: llama.buildType,
    cpu_variant: cpuVariants(),
    system_info: llama.systemInfo,
    threads,
    prefill_context: prefill.contextSize,
    decode_context: decode.contextSize,
    batch_size: { prefill: prefill.batchSize, decode: decode.batchSize },
    load_seconds: loadSeconds,
  });
  return { prefillSequence: prefill.getSequence(), decodeSequences };
}

// Greedy, and an end-of-generation token is one more token: both engines make n tokens.
const GREEDY = { temperature: 0, yieldEogToken: true };

async function runPrefill(sequence, tokens) {
  await sequence.clearHistory();
  const started = performance.now();
  const generator = sequence.evaluate(tokens, GREEDY);
  const first = await generator.next();
  const seconds = (performance.now() - started) / 1e3;
  await generator.return();
  return { seconds, token: first.value };
}

async function generate(sequence, prompt, newTokens) {
  const out = [];
  if (newTokens <= 0) return out;
  for await (const token of sequence.evaluate(prompt, GREEDY)) {
    out.push(token);
    if (out.length >= newTokens) break;
  }
  return out;
}

async function runDecode(sequences, prompts, newTokens) {
  if (prompts.length > sequences.length) {
    throw new Error(`${prompts.length} prompts; this driver has ${sequences.length} sequences`);
  }
  const used = sequences.slice(0, prompts.length);
  await Promise.all(used.map((sequence) => sequence.clearHistory()));
  const started = performance.now();
  // Evaluations started together are batched into one llama_decode per step.
  const tokens = await Promise.all(
    prompts.map((prompt, i) => generate(used[i], prompt, newTokens)),
  );
  return { seconds: (performance.now() - started) / 1e3, tokens };
}

async function main() {
  const { prefillSequence, decodeSequences } = await start();
  const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
  for await (const line of lines) {
    if (!line.trim()) continue;
    const request = JSON.parse(line);
    if (request.op === "prefill") reply(await runPrefill(prefillSequence, request.tokens));
    else if (request.op === "decode") {
      reply(await runDecode(decodeSequences, request.prompts, request.new_tokens));
    } else throw new Error(`unknown op ${JSON.stringify(request.op)}; allowed: prefill, decode`);
  }
}

main().then(
  () => process.exit(0),
  (error) => {
    reply({ error: String(error?.stack ?? error) });
    process.exit(1);
  },
);
