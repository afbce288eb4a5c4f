// The pinvault ledger explorer: asks the vault's read-only API, verifies every answer here in
// the browser (leaf hashes, RFC 9162 inclusion proofs, the Ed25519 signature of the signed
// tree head (the ledger's C2SP checkpoint; "checkpoint" alone on the page means a training
// checkpoint entry),
// documents against their digests) and only then shows it. Ledger text is hostile: it reaches
// the page through textContent only, never as markup.
"use strict";

const enc = new TextEncoder();
const strictUtf8 = new TextDecoder("utf-8", { fatal: true });
const ROWS_SHOWN = 500;

// ------------------------------------------------------------------ bytes and hashes

function b64decode(text) {
  if (typeof text !== "string" || !/^[A-Za-z0-9+/]*={0,2}$/.test(text) || text.length % 4) {
    throw new Error("malformed base64");
  }
  const raw = atob(text);
  const out = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
  return out;
}

function b64encode(bytes) {
  let raw = "";
  for (const b of bytes) raw += String.fromCharCode(b);
  return btoa(raw);
}

function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

function equal(a, b) {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

async function sha256(bytes) {
  return new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
}

const leafHash = (body) => sha256(concat(Uint8Array.of(0), body));
const nodeHash = (left, right) => sha256(concat(Uint8Array.of(1), left, right));

// RFC 9162 §2.1.3.2: the root that leaf `index` of a tree of `size` leaves reaches through
// `path`, or null when the path does not fit the position. Halving by division, not shifts,
// keeps indexes above 2^31 exact.
async function rootFromInclusionProof(index, size, leaf, path) {
  if (!(index < size)) return null;
  let fn = index;
  let sn = size - 1;
  let r = leaf;
  for (const p of path) {
    if (sn === 0) return null;
    if (fn % 2 === 1 || fn === sn) {
      r = await nodeHash(p, r);
      while (fn % 2 === 0 && fn !== 0) {
        fn = Math.floor(fn / 2);
        sn = Math.floor(sn / 2);
      }
    } else {
      r = await nodeHash(r, p);
    }
    fn = Math.floor(fn / 2);
    sn = Math.floor(sn / 2);
  }
  return sn === 0 ? r : null;
}

// RFC 8785 for the values entries and manifests hold (strings, integers, booleans, arrays,
// objects): JSON.stringify already escapes strings exactly as JCS does.
function canonical(value) {
  if (Array.isArray(value)) return "[" + value.map(canonical).join(",") + "]";
  if (value !== null && typeof value === "object") {
    const keys = Object.keys(value).sort();
    return "{" + keys.map((k) => JSON.stringify(k) + ":" + canonical(value[k])).join(",") + "}";
  }
  return JSON.stringify(value);
}

function parseCanonical(what, bytes) {
  const text = strictUtf8.decode(bytes);
  const value = JSON.parse(text);
  if (!equal(enc.encode(canonical(value)), bytes)) {
    throw new Error(`${what} is not in canonical form`);
  }
  return value;
}

function isPowerOfTwo(n) {
  while (n > 1) {
    if (n % 2 === 1) return false;
    n /= 2;
  }
  return n === 1;
}

// RFC 9162 §2.1.4.2: whether `path` proves that the tree of `oldSize` leaves with root
// `oldRoot` is a prefix of the tree of `newSize` leaves with root `newRoot`.
async function consistent(oldSize, newSize, oldRoot, newRoot, path) {
  if (oldSize > newSize) return false;
  if (oldSize === newSize) return path.length === 0 && equal(oldRoot, newRoot);
  if (oldSize === 0) return path.length === 0;
  if (!path.length) return false;
  const hashes = [...path];
  if (isPowerOfTwo(oldSize)) hashes.unshift(oldRoot);
  let fn = oldSize - 1;
  let sn = newSize - 1;
  while (fn % 2 === 1) {
    fn = Math.floor(fn / 2);
    sn = Math.floor(sn / 2);
  }
  let fr = hashes[0];
  let sr = hashes[0];
  for (const c of hashes.slice(1)) {
    if (sn === 0) return false;
    if (fn % 2 === 1 || fn === sn) {
      fr = await nodeHash(c, fr);
      sr = await nodeHash(c, sr);
      while (fn % 2 === 0 && fn !== 0) {
        fn = Math.floor(fn / 2);
        sn = Math.floor(sn / 2);
      }
    } else {
      sr = await nodeHash(sr, c);
    }
    fn = Math.floor(fn / 2);
    sn = Math.floor(sn / 2);
  }
  return sn === 0 && equal(fr, oldRoot) && equal(sr, newRoot);
}

// ------------------------------------------------------------------ keys and signed tree heads

// A Go note verifier key: name+hex key id+base64(0x01 || Ed25519 public key), its key id
// checked against the first four bytes of SHA-256(name || 0x0A || 0x01 || public key).
async function parseVerifierKey(text) {
  // The name holds no "+"; the base64 key may.
  const match = /^([^+\s]+)\+([0-9a-f]{8})\+([A-Za-z0-9+/=]+)$/.exec(text);
  if (!match) throw new Error("the verifier key is not name+keyid+key");
  const [, name, keyId, encoded] = match;
  const raw = b64decode(encoded);
  if (raw.length !== 33 || raw[0] !== 1) throw new Error("the verifier key is not Ed25519");
  const id = (await sha256(concat(enc.encode(name + "\n"), raw))).slice(0, 4);
  if (hex(id) !== keyId) throw new Error("the verifier key's id does not match its key");
  return { text, name, id, publicKey: raw.slice(1) };
}

// A signed tree head: a C2SP signed note holding a tlog-checkpoint, its signature by `key`
// checked.
async function openCheckpoint(note, key) {
  const split = note.lastIndexOf("\n\n");
  if (split < 0 || !note.endsWith("\n")) throw new Error("the signed tree head is not a signed note");
  const body = note.slice(0, split + 1);
  const signatures = note.slice(split + 2, -1).split("\n");
  const mine = [];
  for (const line of signatures) {
    const match = /^\u2014 (\S+) ([A-Za-z0-9+/=]+)$/.exec(line);
    if (!match) throw new Error("the signed tree head has a malformed signature line");
    const raw = b64decode(match[2]);
    if (match[1] === key.name && raw.length === 68 && equal(raw.slice(0, 4), key.id)) {
      mine.push(raw.slice(4));
    }
  }
  if (!mine.length) throw new Error(`the signed tree head has no signature by ${key.name}`);
  let publicKey;
  try {
    publicKey = await crypto.subtle.importKey("raw", key.publicKey, { name: "Ed25519" }, false, [
      "verify",
    ]);
  } catch (error) {
    throw new Error(`this browser cannot check Ed25519 signatures (${error.message})`);
  }
  for (const signature of mine) {
    const ok = await crypto.subtle.verify({ name: "Ed25519" }, publicKey, signature, enc.encode(body));
    if (!ok) throw new Error(`the signed tree head's signature by ${key.name} is not valid`);
  }
  const lines = body.split("\n");
  if (lines.length < 4 || !/^(0|[1-9][0-9]{0,15})$/.test(lines[1])) {
    throw new Error("the signed tree head's body is malformed");
  }
  const root = b64decode(lines[2]);
  if (root.length !== 32 || b64encode(root) !== lines[2]) {
    throw new Error("the signed tree head's root is not 32 bytes in canonical base64");
  }
  if (lines[0] !== key.name) {
    throw new Error(`the signed tree head is of ledger ${lines[0]}, not ${key.name}`);
  }
  return { origin: lines[0], size: Number(lines[1]), root };
}

// The largest signed tree head this browser verified of the vault with this key is kept, and every
// later one must extend it (a consistency proof checked here): a vault that rewrites or rolls
// back its history is caught by the page as by the `vault` command.
const seenKey = (key) => "pinvault-checkpoint:" + key.text;

async function checkHistory(key, checkpoint) {
  let seen = null;
  try {
    seen = JSON.parse(localStorage.getItem(seenKey(key)) || "null");
  } catch {
    seen = null;
  }
  const remember = () => localStorage.setItem(
    seenKey(key), JSON.stringify({ size: checkpoint.size, root: b64encode(checkpoint.root) }));
  if (!seen || !Number.isSafeInteger(seen.size) || typeof seen.root !== "string") {
    remember();
    return "the first signed tree head this browser has verified of this vault";
  }
  const seenRoot = b64decode(seen.root);
  const [older, newer] = seen.size <= checkpoint.size
    ? [{ size: seen.size, root: seenRoot }, checkpoint] : [checkpoint, { size: seen.size, root: seenRoot }];
  let path = [];
  if (older.size !== newer.size && older.size !== 0) {
    const answer = await api(`/api/consistency?old=${older.size}&new=${newer.size}`);
    path = (answer.proof || []).map(b64decode);
  }
  if (!(await consistent(older.size, newer.size, older.root, newer.root, path))) {
    throw new Error(`the vault's tree of size ${checkpoint.size} (root ${b64encode(checkpoint.root)}) ` +
      `does not extend the tree of size ${seen.size} (root ${seen.root}) this browser verified before: ` +
      "the vault rewrote or forked its history");
  }
  if (checkpoint.size > seen.size) remember();
  return `consistent with the signed tree head of size ${seen.size} this browser verified before ` +
    (older.size === newer.size ? "(the same root)" : "(consistency proof checked in this browser)");
}

// ------------------------------------------------------------------ verifying an answer

// Every check the page makes of one API answer. `failures` empty means all of it held.
async function verifyAnswer(answer, asked) {
  const failures = [];
  const result = {
    failures, entries: [], named: [], blobs: {}, missing: {}, checkpoint: null, key: null,
  };
  try {
    result.key = await parseVerifierKey(String(answer.verifier));
    const pinned = settings.pinnedKey();
    if (pinned && pinned !== result.key.text) {
      throw new Error(`the vault's verifier key is ${result.key.text}, not the expected ${pinned}`);
    }
    result.checkpoint = await openCheckpoint(String(answer.checkpoint), result.key);
  } catch (error) {
    failures.push(`signed tree head: ${error.message}`);
  }
  result.witnessed = await checkExpectedWitnesses(String(answer.checkpoint), failures);
  if (result.checkpoint) {
    try {
      result.history = await checkHistory(result.key, result.checkpoint);
    } catch (error) {
      failures.push(`signed tree head: ${error.message}`);
      result.checkpoint = null;
    }
  }
  // `names`: entries that give the digests a view shows their names (an image's, a dataset's),
  // proven as the others are but not asked to match the search.
  if (!Array.isArray(answer.entries) || !Array.isArray(answer.names ?? [])) {
    throw new Error("its entries are not a list");
  }
  const items = [...answer.entries.map((i) => [i, false]), ...(answer.names ?? []).map((i) => [i, true])];
  for (const [item, naming] of items) {
    const shown = { index: item.index, ok: false, problem: "", entry: null };
    (naming ? result.named : result.entries).push(shown);
    const query = naming ? {} : asked;
    try {
      const body = b64decode(item.body);
      const entry = parseCanonical(`entry ${item.index}`, body);
      if (entry === null || typeof entry !== "object" || !Array.isArray(entry.subjects) ||
          entry.meta === null || typeof entry.meta !== "object") {
        throw new Error("its body is not an entry");
      }
      shown.entry = entry;
      if (entry.index !== item.index) {
        throw new Error(`its body says index ${entry.index}`);
      }
      if (query.digest && !(entry.subjects || []).includes(query.digest)) {
        throw new Error(`it does not name ${query.digest}`);
      }
      if (query.index !== undefined && entry.index !== query.index) {
        throw new Error(`it is not entry ${query.index}`);
      }
      if (query.kind && entry.kind !== query.kind) {
        throw new Error(`it is of kind ${entry.kind}, not ${query.kind}`);
      }
      if (query.author && entry.author !== query.author) {
        throw new Error(`it is by ${entry.author}, not ${query.author}`);
      }
      if (query.before !== undefined) {
        // A page of the log is newest first and below its bound.
        if (!(entry.index < query.before)) throw new Error(`it is not before index ${query.before}`);
        const previous = result.entries.length > 1 ? result.entries[result.entries.length - 2].index : null;
        if (previous !== null && !(entry.index < previous)) throw new Error("it is out of order");
      }
      if (query.dataset) {
        const m = entry.meta;
        if (entry.kind !== "dataset" || m.name !== query.dataset.name ||
            (query.dataset.tag && m.tag !== query.dataset.tag)) {
          throw new Error(`it does not pin dataset ${query.dataset.reference}`);
        }
      }
      shown.leaf = await leafHash(body);
      shown.proof = item.proof.map(b64decode);
      if (!result.checkpoint) throw new Error("no verified signed tree head to check it against");
      shown.root = await rootFromInclusionProof(
        item.index, result.checkpoint.size, shown.leaf, shown.proof);
      if (shown.root === null) {
        throw new Error(`its proof does not fit index ${item.index} in a tree of size ${result.checkpoint.size}`);
      }
      if (!equal(shown.root, result.checkpoint.root)) {
        throw new Error("its inclusion proof leads to another root than the signed tree head's");
      }
      shown.ok = true;
    } catch (error) {
      shown.problem = error.message;
      failures.push(`entry ${item.index}: ${error.message}`);
    }
  }
  if (!result.entries.length) failures.push("the answer holds no entry");
  for (const [digest, value] of Object.entries(answer.blobs || {})) {
    if (typeof value !== "string") {
      result.missing[digest] = String((value && value.missing) || "not sent");
      continue;
    }
    const bytes = b64decode(value);
    const got = "sha256:" + hex(await sha256(bytes));
    if (got !== digest) {
      failures.push(`document ${digest}: its bytes hash to ${got}`);
      continue;
    }
    // A document is shown only as what a verified entry pins.
    if (!result.entries.some((s) => s.ok && s.entry.subjects.includes(digest))) {
      failures.push(`document ${digest}: no verified entry shown names it`);
      continue;
    }
    result.blobs[digest] = bytes;
  }
  return result;
}

// ------------------------------------------------------------------ proof bundles

// A proof bundle (docs/bundle.md) opened from a file: every check `vault bundle verify` makes,
// made here with no vault. Its result has the shape of `verifyAnswer`'s, so that the same
// views show it.
const BUNDLE_TYPE = "application/vnd.pinvault.bundle.v1+json";

function bundleReplicateScript(manifest) {
  return `#!/bin/sh\nexec vault replay ${manifest} "$@"\n`;
}

// A witness's cosignature/v1 key: name+hex key id+base64(0x04 || Ed25519 public key).
async function parseWitnessKey(text) {
  const match = /^([^+\s]+)\+([0-9a-f]{8})\+([A-Za-z0-9+/=]+)$/.exec(String(text));
  if (!match) throw new Error(`witness key ${String(text).slice(0, 80)} is not name+keyid+key`);
  const [, name, keyId, encoded] = match;
  const raw = b64decode(encoded);
  if (raw.length !== 33 || raw[0] !== 4) throw new Error(`witness key ${name} is not a cosignature/v1 key`);
  const id = (await sha256(concat(enc.encode(name + "\n"), raw))).slice(0, 4);
  if (hex(id) !== keyId) throw new Error(`witness key ${name}'s id does not match its key`);
  return { text, name, id, label: `${name}+${keyId}`, publicKey: raw.slice(1) };
}

// The cosignatures of the witnesses expected here (settings) on the signed note `note`: the
// labels of those that cosigned it, each one missing or not verifying a failure.
async function checkExpectedWitnesses(note, failures) {
  const cosigned = [];
  for (const text of settings.witnesses()) {
    try {
      const witness = await parseWitnessKey(text);
      await checkCosignature(note, witness);
      cosigned.push(witness.label);
    } catch (error) {
      failures.push(`signed tree head: ${error.message}`);
    }
  }
  return cosigned;
}

// The cosignature by `witness` on the signed note `note`, checked; an error if there is none
// or it does not verify.
async function checkCosignature(note, witness) {
  const split = note.lastIndexOf("\n\n");
  const body = note.slice(0, split + 1);
  for (const line of note.slice(split + 2, -1).split("\n")) {
    const match = /^\u2014 (\S+) ([A-Za-z0-9+/=]+)$/.exec(line);
    if (!match || match[1] !== witness.name) continue;
    const raw = b64decode(match[2]);
    if (raw.length < 4 || !equal(raw.slice(0, 4), witness.id)) continue;
    if (raw.length !== 4 + 8 + 64) throw new Error(`the cosignature by witness ${witness.label} is malformed`);
    const time = new DataView(raw.buffer, raw.byteOffset + 4, 8).getBigUint64(0);
    const message = enc.encode(`cosignature/v1\ntime ${time}\n${body}`);
    const publicKey = await crypto.subtle.importKey("raw", witness.publicKey, { name: "Ed25519" }, false, ["verify"]);
    if (!(await crypto.subtle.verify({ name: "Ed25519" }, publicKey, raw.slice(12), message))) {
      throw new Error(`the cosignature by witness ${witness.label} does not verify`);
    }
    return;
  }
  throw new Error(`the signed tree head carries no cosignature by witness ${witness.label}`);
}

function exactFields(what, value, fields) {
  if (value === null || typeof value !== "object" || Array.isArray(value)) throw new Error(`${what} is not an object`);
  for (const key of Object.keys(value)) if (!fields.includes(key)) throw new Error(`${what} has an unknown field ${key}`);
  for (const key of fields) if (!(key in value)) throw new Error(`${what} has no ${key}`);
  return value;
}

async function verifyBundle(bundle) {
  const failures = [];
  const result = {
    failures, entries: [], named: [], blobs: {}, missing: {}, checkpoint: null, key: null,
    cosigned: [], documents: [], subject: null,
  };
  if (bundle === null || typeof bundle !== "object" || typeof bundle.mediaType !== "string") {
    throw new Error(`it has no mediaType ${BUNDLE_TYPE}`);
  }
  const version = /^application\/vnd\.pinvault\.bundle\.v([0-9]+)\+json$/.exec(bundle.mediaType);
  if (!version) throw new Error(`its mediaType is not ${BUNDLE_TYPE}`);
  if (version[1] !== "1") throw new Error(`bundle format version ${version[1]} is not supported: this page reads version 1`);
  exactFields("the bundle", bundle, ["mediaType", "subject", "verificationMaterial", "tlogEntries", "documents"]);
  const material = exactFields("verificationMaterial", bundle.verificationMaterial, ["verifierKey", "witnessKeys", "checkpoint"]);
  const subject = bundle.subject;
  if (subject === null || typeof subject !== "object" || !["run", "digest", "entry"].includes(subject.type)) {
    throw new Error("its subject is not a run, a digest or an entry");
  }
  exactFields("subject", subject, subject.type === "entry" ? ["type", "index"] : ["type", "digest"]);
  result.subject = subject;
  if (!Array.isArray(bundle.tlogEntries) || !Array.isArray(material.witnessKeys)) {
    throw new Error("its entries or witness keys are not a list");
  }
  const note = String(material.checkpoint);
  const pinned = settings.pinnedKey();
  result.keyFromBundle = !pinned;
  try {
    result.key = await parseVerifierKey(pinned || String(material.verifierKey));
    result.checkpoint = await openCheckpoint(note, result.key);
  } catch (error) {
    failures.push(`signed tree head: ${error.message}`);
  }
  for (const text of material.witnessKeys) {
    try {
      const witness = await parseWitnessKey(text);
      await checkCosignature(note, witness);
      result.cosigned.push(witness.label);
    } catch (error) {
      failures.push(`signed tree head: ${error.message}`);
    }
  }
  result.witnessed = await checkExpectedWitnesses(note, failures);
  let last = -1;
  for (const item of bundle.tlogEntries) {
    exactFields("an entry of the bundle", item, ["logIndex", "canonicalizedBody", "inclusionProof"]);
    const shown = { index: item.logIndex, ok: false, problem: "", entry: null };
    result.entries.push(shown);
    try {
      if (!Number.isSafeInteger(item.logIndex) || item.logIndex <= last) {
        throw new Error("entries are not listed once each, by increasing index");
      }
      last = item.logIndex;
      const body = b64decode(item.canonicalizedBody);
      shown.leaf = await leafHash(body);
      shown.proof = item.inclusionProof.map(b64decode);
      if (!result.checkpoint) throw new Error("no verified signed tree head to check it against");
      shown.root = await rootFromInclusionProof(item.logIndex, result.checkpoint.size, shown.leaf, shown.proof);
      if (shown.root === null || !equal(shown.root, result.checkpoint.root)) {
        throw new Error(`it is not proven in the signed tree head of size ${result.checkpoint.size}: ` +
          "its inclusion proof leads to another root (the entry's bytes or its proof were altered)");
      }
      const entry = parseCanonical(`entry ${item.logIndex}`, body);
      if (entry === null || typeof entry !== "object" || !Array.isArray(entry.subjects) ||
          entry.meta === null || typeof entry.meta !== "object") {
        throw new Error("its body is not an entry");
      }
      shown.entry = entry;
      if (entry.index !== item.logIndex) throw new Error(`its body says index ${entry.index}`);
      if (subject.type === "entry" ? entry.index !== subject.index : !entry.subjects.includes(subject.digest)) {
        throw new Error(`it is not about ${subject.type} ${subject.type === "entry" ? subject.index : subject.digest}`);
      }
      shown.ok = true;
    } catch (error) {
      shown.problem = error.message;
      failures.push(`entry ${item.logIndex}: ${error.message}`);
    }
  }
  if (!result.entries.length) failures.push("the bundle holds no entry");
  if (failures.length) return result;
  try {
    await checkBundleDocuments(bundle, result);
  } catch (error) {
    failures.push(error.message);
  }
  return result;
}

async function checkBundleDocuments(bundle, result) {
  const subject = bundle.subject;
  const documents = bundle.documents;
  if (documents === null || typeof documents !== "object" || Array.isArray(documents)) {
    throw new Error("its documents are not an object");
  }
  const bytes = {};
  for (const [role, text] of Object.entries(documents)) bytes[role] = b64decode(text);
  const digestOf = async (data) => "sha256:" + hex(await sha256(data));
  const entries = result.entries.map((s) => s.entry);
  const allowed = subject.type === "run" ? ["runInputs", "runManifest", "replicateScript"]
    : subject.type === "digest" ? ["datasetManifest"] : [];
  for (const role of Object.keys(bytes)) {
    if (!allowed.includes(role)) throw new Error(`a bundle of ${subject.type} holds a ${role} document`);
  }
  if (subject.type === "digest" && bytes.datasetManifest) {
    const got = await digestOf(bytes.datasetManifest);
    if (got !== subject.digest) throw new Error(`the dataset manifest hashes to ${got}, not to ${subject.digest}: it was altered`);
    result.blobs[subject.digest] = bytes.datasetManifest;
    result.documents.push("dataset manifest");
  }
  if (subject.type !== "run") return;
  const runId = subject.digest;
  if (!bytes.runInputs) throw new Error(`the bundle of run ${runId} has no inputs document`);
  const inputsDigest = await digestOf(bytes.runInputs);
  if (inputsDigest !== runId) {
    throw new Error(`the run inputs document hashes to ${inputsDigest}, not to the run id ${runId}: it was altered`);
  }
  const inputs = parseCanonical("the run inputs document", bytes.runInputs);
  const admission = entries.find((e) => e.kind === "run" && e.meta.stage === "admitted" && e.subjects[0] === runId);
  if (!admission) throw new Error(`the bundle holds no admission entry of run ${runId}`);
  const named = [inputs.image, inputs.dataset, ...(inputs.config !== undefined ? [inputs.config] : [])];
  if (canonical(admission.subjects.slice(1)) !== canonical(named) || admission.meta.seed !== inputs.seed) {
    throw new Error(`run ${runId}'s admission entry ${admission.index} is not of the inputs document`);
  }
  result.blobs[runId] = bytes.runInputs;
  result.documents.push("inputs document");
  if (!bytes.runManifest) {
    if (bytes.replicateScript) throw new Error("the bundle holds a replicate.sh but no run manifest");
    return;
  }
  const digest = await digestOf(bytes.runManifest);
  const team = String(admission.meta.team || "");
  const sealed = entries.filter((e) => e.kind === "run" && e.meta.stage === "manifest" &&
    e.subjects[0] === digest && e.subjects.slice(1).includes(runId));
  if (!sealed.length) {
    throw new Error(`the run manifest hashes to ${digest}, which no entry of the bundle pins as run ${runId}'s manifest: it was altered`);
  }
  if (!team || !sealed.some((e) => e.meta.team === team)) {
    throw new Error(`run manifest ${digest} was not sealed by team ${team || "none"}, which the run was admitted for`);
  }
  const manifest = parseCanonical(`run manifest ${digest}`, bytes.runManifest);
  if (manifest.type !== "pinvault.run-manifest" || manifest.v !== 1 || manifest.run !== runId ||
      !equal(enc.encode(canonical(manifest.inputs)), bytes.runInputs)) {
    throw new Error(`run manifest ${digest} is not a manifest of run ${runId} and its inputs`);
  }
  const pinned = new Set(entries.filter((e) => e.subjects.length === 2 && e.subjects[1] === runId)
    .map((e) => `${e.kind} ${e.subjects[0]}`));
  for (const o of manifest.outputs || []) {
    if (!pinned.has(`artefact ${o.sha256}`)) throw new Error(`run manifest ${digest} lists output ${o.sha256}, which no artefact entry of the bundle pins for the run`);
  }
  for (const c of manifest.checkpoints || []) {
    if (!pinned.has(`checkpoint ${c.manifest}`)) throw new Error(`run manifest ${digest} lists checkpoint ${c.manifest}, which no checkpoint entry of the bundle pins for the run`);
  }
  result.blobs[digest] = bytes.runManifest;
  result.documents.push("run manifest");
  if (bytes.replicateScript) {
    if (!equal(bytes.replicateScript, enc.encode(bundleReplicateScript(digest)))) {
      throw new Error(`replicate.sh is not the script that replays run manifest ${digest}: it was altered`);
    }
    result.documents.push("replicate.sh");
  }
}

// A failed verification: its reasons, and nothing of what failed.
function showFailed(node, what, failures) {
  node.className = "failed";
  node.dataset.state = "failed";
  node.replaceChildren(
    el("div", { text: `Verification FAILED: ${what}. Nothing of it is shown.` }),
    el("ul", {}, ...failures.map((f) => el("li", { text: f }))));
}

function showBundleVerdict(checked, file) {
  const node = $("verdict");
  node.hidden = false;
  if (checked.failures.length) {
    showFailed(node, `proof bundle ${file} is not what the vault signed`, checked.failures);
    return;
  }
  const cp = checked.checkpoint;
  const subject = checked.subject;
  const what = subject.type === "entry" ? `entry #${subject.index}` : `${subject.type} ${subject.digest}`;
  const lines = [
    `Proof bundle ${file}, of ${what}: inclusion of ${checked.entries.length} ` +
      `${checked.entries.length === 1 ? "entry" : "entries"} in the signed tree head of ${cp.origin}, size ` +
      `${cp.size} (root ${b64encode(cp.root)}), verified in this browser with no vault.`,
    `Signed tree head's Ed25519 signature verified with key ${checked.key.text}` +
      (checked.keyFromBundle
        ? ": a key taken from the bundle itself, which shows only that the bundle is consistent; set the vault's expected key to anchor it."
        : " (the expected key set here)."),
  ];
  if (checked.witnessed.length) {
    lines.push(`Cosigned by witness ${checked.witnessed.join(", ")} (the witnesses expected here).`);
  }
  const others = checked.cosigned.filter((label) => !checked.witnessed.includes(label));
  if (others.length) {
    lines.push(`Cosigned by witness ${others.join(", ")} (keys from the bundle).`);
  }
  if (checked.documents.length) lines.push(`Documents checked: ${checked.documents.join(", ")}.`);
  lines.push("A bundle proves that what it holds is in the ledger; it cannot show that nothing was left out.");
  node.className = "verified";
  node.dataset.state = "verified";
  node.replaceChildren(el("div", { text: "Verified" }), el("ul", {}, ...lines.map((l) => el("li", { text: l }))));
}

async function openBundle(file) {
  ++searches;
  clear();
  status(`Verifying proof bundle ${file.name} …`);
  let checked;
  try {
    const bytes = new Uint8Array(await file.arrayBuffer());
    checked = await verifyBundle(JSON.parse(strictUtf8.decode(bytes)));
  } catch (error) {
    checked = { failures: [`the file is not a proof bundle: ${error.message}`], entries: [] };
  }
  showBundleVerdict(checked, file.name);
  status("");
  if (checked.failures.length) return;
  names = new Map();
  for (const { entry } of checked.entries) {
    const name = nameOf(entry);
    if (name && entry.subjects.length && !names.has(entry.subjects[0])) names.set(entry.subjects[0], name);
  }
  showEntries(checked, "Entries in the proof bundle");
  if (checked.subject.type !== "entry") $("view").replaceChildren(...viewOf(checked, checked.subject.digest));
}

// ------------------------------------------------------------------ the page

const $ = (id) => document.getElementById(id);

// An element with text only: no argument is ever parsed as markup.
function el(tag, attributes, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes || {})) {
    if (name === "text") node.textContent = value;
    else if (name === "onclick") node.addEventListener("click", value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// The names verified entries of the answer shown give their first subject (a dataset's or an
// image's `name`, with its `tag`), shown beside the digest.
let names = new Map();

function nameOf(entry) {
  const name = entry.meta.name;
  if (typeof name !== "string" || !name) return "";
  return typeof entry.meta.tag === "string" && entry.meta.tag ? `${name}@${entry.meta.tag}` : name;
}

function short(digest) {
  const [algorithm, value] = digest.split(":");
  return `${algorithm}:${value.slice(0, 4)}\u2026${value.slice(-4)}`;
}

// A digest as its algorithm and the first and last four hex digits, the whole of it in the
// title and the copy button's clipboard, and a search for it on a click.
function digestLink(digest) {
  if (!/^(sha256|blake3):[0-9a-f]{64}$/.test(digest)) return el("code", { text: digest });
  const copy = el("button", { type: "button", class: "copy", title: "Copy the full digest", text: "copy" });
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(digest);
      copy.textContent = "copied";
    } catch {
      // No clipboard here (a page not served from loopback): show the whole digest instead.
      link.textContent = digest;
    }
  });
  const link = el("button", {
    type: "button", class: "link digest", title: digest, text: short(digest), onclick: () => go(digest),
  });
  const name = names.get(digest);
  const parts = name ? [el("span", { class: "name", text: name }), " "] : [];
  return el("span", { class: "digest-ref", "data-digest": digest }, ...parts, link, " ", copy);
}

function table(headings, rows) {
  const body = el("tbody", {}, ...rows.map((cells) => el("tr", {}, ...cells.map((c) => el("td", {}, c)))));
  if (!headings.some(Boolean)) return el("table", {}, body);
  const head = el("tr", {}, ...headings.map((h) => el("th", { text: h })));
  return el("table", {}, el("thead", {}, head), body);
}

function rowsOf(object) {
  return Object.keys(object).sort().map((k) => [k, object[k]]);
}

const settings = {
  token: () => sessionStorage.getItem("pinvault-token") || "",
  pinnedKey: () => localStorage.getItem("pinvault-verifier-key") || "",
  // The witnesses whose cosignatures a signed tree head must carry: one key a line.
  witnesses: () => (localStorage.getItem("pinvault-witnesses") || "").split("\n").filter((line) => line.trim()),
  save() {
    const token = $("token").value.trim();
    if (token) sessionStorage.setItem("pinvault-token", token);
    else sessionStorage.removeItem("pinvault-token");
    const key = $("pinned-key").value.trim();
    if (key) localStorage.setItem("pinvault-verifier-key", key);
    else localStorage.removeItem("pinvault-verifier-key");
    const witnesses = $("expected-witnesses").value.split("\n").map((line) => line.trim()).filter(Boolean);
    if (witnesses.length) localStorage.setItem("pinvault-witnesses", witnesses.join("\n"));
    else localStorage.removeItem("pinvault-witnesses");
  },
};

class ApiError extends Error {}

async function api(path) {
  const headers = {};
  if (settings.token()) headers.Authorization = "Bearer " + settings.token();
  const response = await fetch(path, { headers, credentials: "omit", cache: "no-store" });
  let value;
  try {
    value = await response.json();
  } catch {
    throw new ApiError(`the vault answered ${response.status} without JSON`);
  }
  if (response.status === 401 || response.status === 403) {
    $("token-box").hidden = false;
    $("settings").open = true;
  }
  if (!response.ok) throw new ApiError(String(value.error || `HTTP ${response.status}`));
  return value;
}

function status(text, error) {
  const node = $("status");
  node.textContent = text;
  node.className = error ? "error" : "";
}

function clear() {
  for (const id of ["view", "entries", "entry-detail"]) $(id).replaceChildren();
  $("verdict").hidden = true;
}

function showVerdict(checked, answer) {
  const node = $("verdict");
  node.hidden = false;
  if (checked.failures.length) {
    showFailed(node, "this answer is not what the vault signed", checked.failures);
    return;
  }
  const cp = checked.checkpoint;
  const documents = Object.keys(checked.blobs);
  const lines = [
    `Inclusion of ${checked.entries.length} ${checked.entries.length === 1 ? "entry" : "entries"} ` +
      `in the signed tree head of size ${cp.size} (root ${b64encode(cp.root)}) verified in this browser: ` +
      "each leaf hash SHA-256(0x00 || entry bytes) walked up its RFC 9162 inclusion proof.",
    `Signed tree head's Ed25519 signature verified in this browser with key ${checked.key.text}` +
      (settings.pinnedKey() ? " (the expected key set here)." : " (the vault's own key: set an expected key to pin it)."),
    `Signed tree head history: ${checked.history}.`,
  ];
  if (checked.witnessed.length) {
    lines.push(`Cosigned by witness ${checked.witnessed.join(", ")} (the witnesses expected here).`);
  }
  if (documents.length) {
    lines.push(`Documents hashed in this browser to the digests entries pin: ${documents.join(", ")}.`);
  }
  if (answer.more === true) {
    lines.push(`More entries name this than one answer carries: ${checked.entries.length} are shown, the first ones and any run entries of a run.`);
  }
  lines.push("Proofs show that what is shown is in the ledger; they cannot show that the vault left nothing out.");
  node.className = "verified";
  node.dataset.state = "verified";
  node.replaceChildren(el("div", { text: "Verified" }), el("ul", {}, ...lines.map((l) => el("li", { text: l }))));
}

// Only called on an answer whose every check held: a failed answer shows its verdict alone.
function showEntries(checked, title) {
  const rows = checked.entries.map((shown) => {
    const e = shown.entry;
    return [
      el("button", { type: "button", class: "link", text: `#${shown.index}`, onclick: () => showEntry(shown, checked) }),
      String(e.kind),
      String(e.time),
      String(e.author),
      el("div", {}, ...e.subjects.map((s) => el("div", {}, digestLink(String(s))))),
      el("div", {}, ...Object.entries(e.meta).map(([k, v]) => el("div", { class: "meta", text: `${k}=${v}` }))),
      "verified",
    ];
  });
  const node = table(["entry", "kind", "time", "author", "subjects", "metadata", "inclusion proof"], rows);
  node.classList.add("entries");
  $("entries").replaceChildren(el("h2", { text: title || "Entries" }), node);
}

function showEntry(shown, checked) {
  const parts = [el("h2", { text: `Entry #${shown.index}` })];
  if (shown.entry) parts.push(el("pre", { id: "entry-json", text: JSON.stringify(shown.entry, null, 2) }));
  const facts = [
    ["leaf hash", shown.leaf ? hex(shown.leaf) : ""],
    ["computed root", shown.root ? b64encode(shown.root) : ""],
    ["signed tree head", `size ${checked.checkpoint.size}, root ${b64encode(checked.checkpoint.root)}`],
    ["proof", shown.ok ? "verified" : `FAILED: ${shown.problem}`],
  ];
  parts.push(table(["", ""], facts.map(([k, v]) => [k, el("code", { text: v })])));
  parts.push(el("h3", { text: "Inclusion proof (nearest the leaf first)" }));
  parts.push(el("ol", {}, ...(shown.proof || []).map((h) => el("li", {}, el("code", { text: hex(h) })))));
  $("entry-detail").replaceChildren(...parts);
}

function documentOf(checked, digest, what) {
  const bytes = checked.blobs[digest];
  if (!bytes) {
    return { error: checked.missing[digest] || `the vault sent no ${what} ${digest}` };
  }
  try {
    return { value: parseCanonical(what, bytes) };
  } catch (error) {
    return { error: `${what} ${digest}: ${error.message}` };
  }
}

function section(title, ...children) {
  return el("div", {}, el("h2", { text: title }), ...children);
}

function runManifestParts(manifest, digest) {
  const parts = [];
  const inputs = manifest.inputs || {};
  parts.push(section("Outputs", table(["path", "sha256", "size"],
    (manifest.outputs || []).map((o) => [String(o.path), digestLink(String(o.sha256)), String(o.size)]))));
  parts.push(section("Training checkpoints", table(["step", "checkpoint manifest"],
    (manifest.checkpoints || []).map((c) => [String(c.step), digestLink(String(c.manifest))]))));
  const env = manifest.environment || {};
  const envRows = [["host", env.host], ["python", env.python], ["platform", env.platform],
    ...rowsOf(env.variables || {})].map(([k, v]) => [String(k), String(v ?? "")]);
  parts.push(section("Environment", table(["", ""], envRows)));
  const script = `#!/bin/sh\nexec vault replay ${digest} "$@"\n`;
  const link = el("a", { class: "replicate", download: "replicate.sh", text: "replicate.sh" });
  link.href = URL.createObjectURL(new Blob([script], { type: "text/x-shellscript" }));
  parts.push(section("Run manifest",
    el("p", {}, "Manifest ", digestLink(digest), ` for run `, digestLink(String(manifest.run)),
      `, team ${String(manifest.team)}.`),
    el("p", {}, "Replay it: ", link, " (", el("code", { text: `vault replay ${digest}` }), ")")));
  return { parts, inputs };
}

function inputsTable(inputs) {
  const rows = [
    ["image", digestLink(String(inputs.image))],
    ["dataset", digestLink(String(inputs.dataset))],
  ];
  if (inputs.config !== undefined) rows.push(["config", digestLink(String(inputs.config))]);
  rows.push(["seed", el("code", { id: "seed", text: String(inputs.seed) })]);
  if (inputs.nonce !== undefined) rows.push(["nonce", el("code", { text: String(inputs.nonce) })]);
  return section("Inputs", table(["input", "value"], rows));
}

function viewRun(checked, runId, admission) {
  const team = String(admission.meta.team || "");
  const parts = [el("h2", { text: "Run" }),
    el("p", {}, "Run id ", el("code", { id: "run-id", text: runId }),
      `, admitted for team ${team || "(none)"} at ${admission.time} (entry #${admission.index}).`)];
  const inputs = documentOf(checked, runId, "run inputs document");
  if (inputs.error) parts.push(el("p", { class: "error", text: inputs.error }));
  else parts.push(inputsTable(inputs.value));
  // The run's own manifest, as the run library reads it: pinned for the run by the team of
  // its admission, not by a replay.
  const sealed = checked.entries.map((s) => s.entry).filter((e) => e.kind === "run" &&
    e.meta.stage === "manifest" && e.subjects.slice(1).includes(runId) && team &&
    e.meta.team === team && e.meta.replay === undefined);
  if (!sealed.length) {
    parts.push(el("p", { text: "Not sealed: the run's team has published no run manifest for it yet." }));
    const own = checked.entries.map((s) => s.entry).filter((e) => e.meta.team === team);
    parts.push(section("Outputs recorded so far", table(["path", "sha256", "size"],
      own.filter((e) => e.kind === "artefact").map((e) => [String(e.meta.path), digestLink(e.subjects[0]), String(e.meta.size)]))));
    parts.push(section("Training checkpoints committed so far", table(["step", "checkpoint manifest"],
      own.filter((e) => e.kind === "checkpoint").map((e) => [String(e.meta.step), digestLink(e.subjects[0])]))));
    return parts;
  }
  // The latest manifest of each task: one, but for a job array, whose tasks seal their own.
  const latest = new Map();
  for (const e of sealed) latest.set(String(e.meta.task ?? ""), e.subjects[0]);
  const tasks = [...latest.keys()].sort((a, b) => Number(a) - Number(b) || a.localeCompare(b));
  for (const task of tasks) {
    const digest = latest.get(task);
    if (task !== "") parts.push(el("h2", { class: "task", text: `Task ${task}` }));
    const manifest = documentOf(checked, digest, "run manifest");
    if (manifest.error) {
      parts.push(el("p", { class: "error", text: manifest.error }));
    } else if (manifest.value.run !== runId) {
      parts.push(el("p", { class: "error", text: `run manifest ${digest} is of run ${manifest.value.run}` }));
    } else {
      parts.push(...runManifestParts(manifest.value, digest).parts);
    }
  }
  return parts;
}

function viewDataset(checked, digest, pin) {
  const parts = [el("h2", { text: `Dataset ${String(pin.meta.name ?? "")}` }),
    el("p", {}, "Manifest ", el("code", { text: digest }), `, pinned at entry #${pin.index}.`)];
  const manifest = documentOf(checked, digest, "dataset manifest");
  if (manifest.error) {
    parts.push(el("p", { class: "error", text: manifest.error }));
    return parts;
  }
  const files = manifest.value.files || [];
  const total = files.reduce((n, f) => n + Number(f.size), 0);
  parts.push(el("p", { text: `${files.length} files, ${total} bytes.` }));
  parts.push(table(["path", "size", "mode", "sha256"], files.slice(0, ROWS_SHOWN).map((f) =>
    [String(f.path), String(f.size), String(f.mode), digestLink(String(f.sha256))])));
  if (files.length > ROWS_SHOWN) parts.push(el("p", { text: `… and ${files.length - ROWS_SHOWN} more files.` }));
  return parts;
}

function viewCheckpoint(checked, digest) {
  const manifest = documentOf(checked, digest, "checkpoint manifest");
  if (manifest.error) return [el("p", { class: "error", text: manifest.error })];
  const m = manifest.value;
  return [el("h2", { text: `Training checkpoint, step ${String(m.step)}` }),
    el("p", {}, "Of run ", digestLink(String(m.run)), "."),
    table(["path", "sha256", "size"], (m.files || []).map((f) =>
      [String(f.path), digestLink(String(f.sha256)), String(f.size)]))];
}

function viewOf(checked, digest) {
  const entries = checked.entries.map((s) => s.entry);
  const first = (test) => entries.find((e) => e.subjects[0] === digest && test(e));
  const admission = first((e) => e.kind === "run" && e.meta.stage === "admitted");
  if (admission) return viewRun(checked, digest, admission);
  const manifestPin = first((e) => e.kind === "run" && e.meta.stage === "manifest");
  if (manifestPin) {
    const manifest = documentOf(checked, digest, "run manifest");
    if (manifest.error) return [el("p", { class: "error", text: manifest.error })];
    const { parts, inputs } = runManifestParts(manifest.value, digest);
    return [el("h2", { text: "Run manifest" }), inputsTable(inputs), ...parts];
  }
  const dataset = first((e) => e.kind === "dataset");
  if (dataset) return viewDataset(checked, digest, dataset);
  if (first((e) => e.kind === "checkpoint")) return viewCheckpoint(checked, digest);
  return [];
}

// What a search asks for: a digest, an entry (#index), a page of the log (`recent`,
// `kind:KIND`, `author:NAME`, `before:INDEX`, in any order) or a dataset (NAME or NAME@TAG).
function parseSearch(q) {
  const byIndex = /^#?([0-9]{1,15})$/.exec(q);
  if (byIndex) return { path: `/api/entry?index=${byIndex[1]}`, query: { index: Number(byIndex[1]) } };
  if (/^(sha256|blake3):/.test(q)) return { path: `/api/lookup?digest=${encodeURIComponent(q)}`, query: {}, digest: true };
  const words = q.split(/\s+/);
  if (words.every((w) => /^(recent|kind:\S+|author:\S+|before:[0-9]{1,15})$/.test(w))) {
    const query = { log: true };
    const params = new URLSearchParams();
    for (const w of words) {
      const [name, value] = [w.slice(0, w.indexOf(":")), w.slice(w.indexOf(":") + 1)];
      if (w === "recent") continue;
      if (name === "before") query.before = Number(value);
      else query[name] = value;
      params.set(name, value);
    }
    return { path: `/api/log?${params}`, query };
  }
  const dataset = /^([^@]+)(?:@([^@]+))?$/.exec(q);
  if (!dataset) throw new Error(`${q}: not a digest, #index, dataset NAME@TAG, recent, kind:KIND or author:NAME`);
  const [, name, tag] = dataset;
  const params = new URLSearchParams({ name });
  if (tag) params.set("tag", tag);
  return { path: `/api/dataset?${params}`, query: { dataset: { name, tag: tag || "", reference: q } } };
}

function logTitle(query) {
  const words = [query.kind ? `Entries of kind ${query.kind}` : "Recent entries"];
  if (query.author) words.push(`by ${query.author}`);
  return words.join(" ") + ", newest first";
}

// Only the latest search shows its answer, however the answers arrive.
let searches = 0;

// A search the user asks for: it becomes the address's fragment, so that Back and Forward
// (which change only the fragment) bring the earlier view back through `hashchange`.
function go(text) {
  const q = text.trim();
  const fragment = "#" + encodeURIComponent(q);
  if (q && location.hash !== fragment) location.hash = fragment;
  else search(q);
}

async function search(text) {
  const turn = ++searches;
  const q = text.trim();
  $("search").value = q;
  clear();
  if (!q) return;
  let asked;
  try {
    asked = parseSearch(q);
  } catch (error) {
    status(error.message, true);
    return;
  }
  const { query } = asked;
  status(`Looking up ${q} …`);
  let answer;
  try {
    answer = await api(asked.path);
  } catch (error) {
    if (turn === searches) status(error.message, true);
    return;
  }
  if (turn !== searches) return;
  if (asked.digest) query.digest = String(answer.query);
  if (query.log && query.before === undefined) query.before = Number.MAX_SAFE_INTEGER;
  status("Verifying …");
  let checked;
  try {
    checked = await verifyAnswer(answer, query);
  } catch (error) {
    // An answer not even shaped like one: nothing of it is shown.
    checked = { failures: [`the answer is malformed: ${error.message}`], entries: [] };
  }
  if (turn !== searches) return;
  showVerdict(checked, answer);
  status("");
  if (checked.failures.length) return;
  names = new Map();
  for (const { entry } of [...checked.entries, ...checked.named]) {
    const name = nameOf(entry);
    if (name && entry.subjects.length && !names.has(entry.subjects[0])) names.set(entry.subjects[0], name);
  }
  if (query.log) {
    showEntries(checked, logTitle(query));
    const next = answer.next;
    if (Number.isSafeInteger(next) && next > 0) {
      const words = q.split(/\s+/).filter((w) => !w.startsWith("before:"));
      const older = [...words.filter((w) => w !== "recent"), `before:${next}`].join(" ");
      $("entries").append(el("p", {}, el("button", {
        type: "button", id: "older", text: "Older entries", onclick: () => go(older),
      })));
    }
    return;
  }
  showEntries(checked);
  if (query.digest) {
    $("view").replaceChildren(...viewOf(checked, query.digest));
  } else if (query.dataset) {
    const newest = checked.entries[0].entry;
    const authors = [...new Set(checked.entries.map((s) => s.entry.author))];
    const parts = viewDataset(checked, newest.subjects[0], newest);
    if (authors.length > 1) {
      parts.splice(1, 0, el("p", { class: "error", text:
        `Pinned as ${query.dataset.reference} by more than one author (${authors.join(", ")}): the newest pin is shown.` }));
    }
    $("view").replaceChildren(...parts);
  }
}

function searchFromFragment() {
  let wanted = "";
  try {
    wanted = decodeURIComponent(location.hash.slice(1));
  } catch {
    status("the address after # is not a search", true);
    return;
  }
  search(wanted);
}

async function refresh() {
  $("pinned-key").value = settings.pinnedKey();
  $("expected-witnesses").value = settings.witnesses().join("\n");
  $("token").value = settings.token();
  if (location.protocol === "file:") {
    // The page opened from a copy of its files: no vault to ask, bundles only.
    status("Opened from a file, with no vault: open a proof bundle to verify it here.");
    return;
  }
  try {
    const vault = await api("/api/vault");
    $("vault-key").textContent = String(vault.verifier);
    if (vault.credentials) $("token-box").hidden = false;
    status(`The ledger holds ${vault.size} entries.`);
  } catch (error) {
    status(error.message, true);
    return;
  }
  if (location.hash.length > 1) searchFromFragment();
}

document.addEventListener("DOMContentLoaded", () => {
  $("search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    go($("search").value);
  });
  $("recent").addEventListener("click", () => go("recent"));
  $("bundle-file").addEventListener("change", () => {
    const file = $("bundle-file").files[0];
    if (file) openBundle(file);
  });
  $("settings-form").addEventListener("submit", (event) => {
    event.preventDefault();
    settings.save();
    refresh();
  });
  window.addEventListener("hashchange", searchFromFragment);
  refresh();
});
