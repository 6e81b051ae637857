// Greedy decode with llama.cpp (the prebuilt CPU build in the npm package node-llama-cpp) for
// `python -m feedback bench --peers`: the same prompt token ids as the engine, `rounds` times on a
// fresh sequence, reading this process's CPU time (every thread) as each token comes.
// argv: package folder, GGUF path, a JSON file of the prompt ids, tokens, threads, rounds. Prints JSON.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [pkg, modelPath, idsFile, tokens, threads, rounds] = process.argv.slice(2);
const { getLlama, LlamaLogLevel } = await import(pathToFileURL(join(pkg, "dist", "index.js")).href);
const ids = JSON.parse(readFileSync(idsFile, "utf8"));
// build "never": only the shipped binaries (a source build would need a compiler and minutes)
const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error });
const model = await llama.loadModel({ modelPath });
const context = await model.createContext({
  contextSize: ids.length + Number(tokens) + 8,
  threads: Number(threads),
  batchSize: Math.max(ids.length, 32),
});
const cpuSeconds = () => {
  const used = process.cpuUsage();
  return (used.user + used.system) / 1e6;
};
const out = [];
for (let round = 0; round < Number(rounds); round++) {
  const sequence = context.getSequence();
  const marks = [];
  const generated = [];
  for await (const token of sequence.evaluate(ids, { temperature: 0 })) {
    marks.push(cpuSeconds());
    generated.push(token);
    if (generated.length >= Number(tokens)) break;
  }
  out.push({ marks, tokens: generated });
  sequence.dispose();
}
console.log(JSON.stringify({ rounds: out, version: llama.llamaCppRelease?.release ?? null }));
await context.dispose();
await model.dispose();
