// The built-in chat page in headless Chromium: a seeded markdown reply renders
// (code blocks, lists, links) with hostile HTML shown as text; type a message,
// see a reply stream in, press Stop, check the server freed the slot, chat once
// more; reload (the conversation stays); regenerate; edit; switch and delete
// conversations in the sidebar.
// Usage: PULSAR_SERVER_URL=... PULSAR_API_KEY=... PULSAR_E2E_ARTIFACTS=DIR node ui_test.cjs
// PULSAR_UI_HTML=FILE serves FILE in place of the built-in page (to try a
// change to ui.html without a rebuild, or to see a check fail on a broken page).
"use strict";
const { chromium } = require("playwright-core");
const crypto = require("crypto");
const fs = require("fs");
const path = require("path");

const URL = process.env.PULSAR_SERVER_URL.replace(/\/$/, "");
const KEY = process.env.PULSAR_API_KEY || "";
const ART = process.env.PULSAR_E2E_ARTIFACTS || ".";
const auth = KEY ? { Authorization: "Bearer " + KEY } : {};

function check(cond, what) {
  if (!cond) throw new Error("FAIL: " + what);
  console.log("ok: " + what);
}

async function api(p, body) {
  const r = await fetch(URL + p, {
    method: body ? "POST" : "GET",
    headers: { "Content-Type": "application/json", ...auth },
    body: body ? JSON.stringify(body) : undefined,
  });
  const j = await r.json();
  if (!r.ok) throw new Error(p + ": " + JSON.stringify(j));
  return j;
}

// A message whose greedy reply runs long (the test model's text is noise and
// some replies stop at once), so Stop lands mid-stream.
async function longMessage() {
  for (let k = 0; k < 40; k++) {
    const m = "Write a long story about a dragon who learns to bake bread, part " + (k + 1) + ".";
    const j = await api("/v1/chat/completions", { messages: [{ role: "user", content: m }], max_tokens: 96, temperature: 0 });
    if (j.choices[0].finish_reason === "length") return m;
  }
  throw new Error("no message of 40 gets a long reply");
}

// The messages shown: role, id, state and text of each.
const shown = (page) => page.$$eval("#log .msg", (ms) => ms.map((m) => ({
  role: m.classList.contains("user") ? "user" : "assistant", id: m.dataset.id, state: m.dataset.state || null, text: m.querySelector(".body").textContent,
})));
// The current conversation as the page stored it.
const stored = (page) => page.evaluate(() => { const s = JSON.parse(localStorage.getItem("pulsar-chats")); return s.chats.find((c) => c.id === s.current); });
// Wait until the last message is an assistant reply that finished, other than `notId`.
async function replyDone(page, notId) {
  await page.waitForFunction((id) => {
    const m = [...document.querySelectorAll("#log .msg")].pop();
    return m && m.classList.contains("assistant") && m.dataset.id !== id && m.dataset.state && m.dataset.state !== "streaming" && !document.getElementById("send").disabled;
  }, notId || null, { timeout: 60000 });
}
const shot = (page, name) => page.screenshot({ path: path.join(ART, name), fullPage: true });

// A seeded reply: markdown the renderer must show, and HTML it must not run.
const CODE = 'def greet(name):\n    return "<b>hi</b> " + name  # <script>window.__pwned=1</script>';
const MARKDOWN = [
  "## Steps", "", "Some **bold**, *italic* and `inline <code>`.", "",
  "- first item", "- second item with [a link](https://example.com/docs)", "",
  "1. one", "2. two", "", "> a quote", "",
  "```python", CODE, "```", "",
  '<img src=x onerror="window.__pwned=1">', "<script>window.__pwned=1</script>",
  "[click me](javascript:window.__pwned=1) and [again]( JaVaScRiPt:window.__pwned=1)",
  '<a href="javascript:window.__pwned=1">raw</a>', "",
  "```js", "const partial = 1", // an unclosed fence, as while streaming
].join("\n");
const USER_HTML = "<b>not bold</b> *not em*";

async function main() {
  const message = await longMessage();
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1200, height: 800 }, permissions: ["clipboard-read", "clipboard-write"] });
    page.on("pageerror", (e) => { console.error("page error: " + e); process.exitCode = 1; });
    if (process.env.PULSAR_UI_HTML) {
      const html = fs.readFileSync(process.env.PULSAR_UI_HTML, "utf8");
      await page.route(URL + "/", (r) => r.fulfill({ status: 200, contentType: "text/html; charset=utf-8", body: html }));
      console.log("serving " + process.env.PULSAR_UI_HTML + " as the page");
    }
    const requests = [];
    page.on("request", (r) => { if (r.method() === "POST" && r.url().endsWith("/v1/chat/completions")) requests.push(JSON.parse(r.postData())); });
    const clipboard = () => page.evaluate(() => navigator.clipboard.readText());

    // The page's script is the one its Content-Security-Policy admits.
    const html = process.env.PULSAR_UI_HTML ? fs.readFileSync(process.env.PULSAR_UI_HTML, "utf8") : await (await fetch(URL + "/")).text();
    const script = /<script>([\s\S]*?)<\/script>/.exec(html)[1];
    const hash = "'sha256-" + crypto.createHash("sha256").update(script, "utf8").digest("base64") + "'";
    const csp = /<meta http-equiv="Content-Security-Policy" content="([^"]*)">/.exec(html);
    const scriptSrc = csp && csp[1].split(";").map((d) => d.trim().split(/\s+/)).find((d) => d[0] === "script-src");
    check(scriptSrc && scriptSrc.includes(hash) && !scriptSrc.includes("'unsafe-inline'"), "the page's CSP admits its own script by hash (want " + hash + " in ui.html's meta)");

    await page.goto(URL + "/");
    await page.fill("#apikey", KEY);
    await page.dispatchEvent("#apikey", "change");
    await page.waitForFunction(() => /^model: gemma/.test(document.getElementById("model").textContent), null, { timeout: 10000 });
    check(true, "the page names the served model once the key is entered");
    // The sampling fields a person has not set show the server's defaults (GET /props).
    const props = await api("/props");
    const dflt = props.default_generation_settings.params;
    await page.waitForFunction((t) => document.getElementById("top_k").value === String(t), dflt.top_k, { timeout: 10000 }).catch(() => {});
    const shownDefaults = await page.evaluate(() => ["temperature", "top_p", "top_k", "min_p"].map((k) => parseFloat(document.getElementById(k).value)));
    check(JSON.stringify(shownDefaults) === JSON.stringify([dflt.temperature, dflt.top_p, dflt.top_k, dflt.min_p].map((v) => parseFloat(String(v)))),
      "the page's sampling defaults are the server's: " + JSON.stringify(shownDefaults) + " vs " + JSON.stringify(dflt));

    // Markdown, from a conversation seeded in the page's storage format.
    await page.evaluate(({ md, user }) => {
      const s = JSON.parse(localStorage.getItem("pulsar-chats"));
      s.chats.push({ id: "seeded", title: "seeded markdown", updated: 1, messages: [
        { id: "seeded-u", role: "user", content: user }, { id: "seeded-a", role: "assistant", content: md, state: "done" }] });
      s.current = "seeded";
      localStorage.setItem("pulsar-chats", JSON.stringify(s));
    }, { md: MARKDOWN, user: USER_HTML });
    await page.reload();
    await page.waitForSelector("#log .msg.assistant");
    await page.waitForTimeout(300); // time for an onerror to fire, were an image made
    check(await page.evaluate(() => window.__pwned) === undefined, "no script from the reply ran (window.__pwned is undefined)");
    check(await page.locator("#log img, #log script, #log iframe, #log [onerror]").count() === 0, "no img or script element was made from the reply");
    const a = page.locator(".msg.assistant .body").last();
    const codes = await a.locator("pre code").allTextContents();
    check(codes.length === 2 && codes[0] === CODE && codes[1] === "const partial = 1", "fenced code renders as pre > code, an unclosed fence too: " + JSON.stringify(codes));
    check(await a.locator("pre code").first().getAttribute("data-lang") === "python" && (await a.locator(".codeblock .lang").first().textContent()) === "python", "the code block names its language");
    check(JSON.stringify(await a.locator("ul > li").allTextContents()) === JSON.stringify(["first item", "second item with a link"]) &&
      JSON.stringify(await a.locator("ol > li").allTextContents()) === JSON.stringify(["one", "two"]), "bulleted and numbered lists render as li");
    check(await a.locator("h2").textContent() === "Steps" && await a.locator("strong").textContent() === "bold" && await a.locator("em").textContent() === "italic" &&
      await a.locator("p > code").textContent() === "inline <code>" && await a.locator("blockquote").textContent() === "a quote", "heading, bold, italic, inline code and quote render");
    const links = await a.locator("a").evaluateAll((as) => as.map((x) => [x.getAttribute("href"), x.rel, x.target, x.textContent]));
    check(JSON.stringify(links) === JSON.stringify([["https://example.com/docs", "noopener noreferrer", "_blank", "a link"]]), "only the https link is a link, opening a new tab without opener: " + JSON.stringify(links));
    const txt = await a.textContent();
    check(txt.includes('<img src=x onerror="window.__pwned=1">') && txt.includes("<script>window.__pwned=1</script>") && txt.includes("click me and again"), "hostile HTML shows as text, a javascript: link as its words");
    const u = page.locator(".msg.user .body").last();
    check(await u.textContent() === USER_HTML && await u.locator("*").count() === 0, "a user message stays plain text");
    await shot(page, "ui-markdown.png");
    await a.locator(".codeblock button.copy-code").first().click();
    check(await clipboard() === CODE, "a code block's copy button copies its code");
    await page.locator(".msg.assistant button.copy").last().click();
    check(await clipboard() === MARKDOWN, "a reply's copy button copies its markdown");
    await page.locator(".msg.user button.copy").last().click();
    check(await clipboard() === USER_HTML, "a user message's copy button copies its text");

    // A new chat: a new entry, current, empty.
    const entries = await page.locator("#chats li").count();
    await page.click("#new");
    check(await page.locator("#chats li").count() === entries + 1 && await page.locator("#log .msg").count() === 0, "New chat adds a conversation and shows it empty");
    const current = await page.$$eval("#chats li.current", (ls) => ls.map((l) => [l.dataset.id, l.querySelector(".title").getAttribute("aria-current")]));
    const chat1 = current.length === 1 ? current[0][0] : null;
    check(chat1 && chat1 !== "seeded" && current[0][1] === "true", "the new conversation is the highlighted one: " + JSON.stringify(current));

    // Stream, Stop, a second turn.
    await page.fill("#temperature", "0");
    await page.fill("#max_tokens", "3500");
    await page.fill("#system", "");
    await page.fill("#input", message);
    await page.click("#send");
    const body = page.locator(".msg.assistant .body").last();
    await page.waitForFunction(() => { const b = document.querySelectorAll(".msg.assistant .body"); return b.length && b[b.length - 1].textContent.length > 0; }, null, { timeout: 30000 });
    const first = (await body.textContent()).length;
    const grown = Math.max(first, 60);
    await page.waitForFunction((n) => { const b = document.querySelectorAll(".msg.assistant .body"); return b[b.length - 1].textContent.length > n; }, grown, { timeout: 60000 });
    check(true, "the reply streams in (" + first + " characters, then past " + grown + ")");
    check(await page.isEnabled("#stop") && !(await page.isEnabled("#send")), "Stop is live while streaming");
    check(/tok\/s/.test(await page.textContent("#status")), "tok/s is shown while streaming");
    check(await body.locator(":scope > .md").count() === 1, "the streaming reply is rendered as markdown as it grows");
    await page.click("#stop");
    await page.waitForSelector(".msg.assistant[data-state]:not([data-state=streaming])", { timeout: 10000 });
    const state = await page.locator(".msg.assistant").last().getAttribute("data-state");
    check(state === "stopped", "Stop ends the stream (state " + state + ")");
    const stoppedAt = (await body.textContent()).length;
    await page.waitForTimeout(300);
    check((await body.textContent()).length === stoppedAt, "no text arrives after Stop");
    await shot(page, "ui-stopped.png");
    // The server noticed the disconnect and freed the slot.
    let m;
    for (let i = 0; i < 100; i++) {
      m = await api("/metrics?format=json");
      if (m.active_sequences === 0 && m.requests_cancelled >= 1) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    check(m.active_sequences === 0 && m.requests_cancelled >= 1, "the server freed the stopped generation's slot: " + JSON.stringify(m));
    // A second turn completes (and reuses the conversation's cached prefix).
    await page.fill("#max_tokens", "8");
    await page.fill("#input", "And then?");
    await page.click("#send");
    await page.waitForFunction(() => { const m = document.querySelectorAll(".msg.assistant"); return m.length === 2 && m[1].dataset.state !== "streaming"; }, null, { timeout: 30000 });
    const state2 = await page.locator(".msg.assistant").last().getAttribute("data-state");
    const status = await page.textContent("#status");
    check(state2 === "done" && /done/.test(status) && /tok\/s/.test(status), "a second turn completes: " + status);
    check(/cached/.test(status) && !/\(0 cached\)/.test(status), "the second turn reused the cached prefix: " + status);
    await shot(page, "ui-second-turn.png");
    const title = await page.locator("#chats li.current .title").textContent();
    check(title.length <= 48 && title.startsWith(message.slice(0, 40)), "the conversation is titled by its first message: " + JSON.stringify(title));

    // A reload shows the same conversation.
    const before = await shown(page);
    await page.reload();
    await page.waitForSelector("#log .msg");
    const after = await shown(page);
    check(before.length === 4 && JSON.stringify(after) === JSON.stringify(before), "a reload shows the same 4 messages (ids, states, text)");
    check(await page.locator("#chats li.current").getAttribute("data-id") === chat1 && await page.inputValue("#max_tokens") === "8", "a reload keeps the current conversation and the settings");
    await shot(page, "ui-reloaded.png");

    // Regenerate: the last reply is replaced, asked again with the same history.
    check(await page.locator("#log button.regen").count() === 1 && await page.locator(".msg.assistant").last().locator("button.regen").count() === 1, "only the last reply has Regenerate");
    const hist = (await stored(page)).messages;
    const nReq = requests.length, total0 = (await api("/metrics?format=json")).requests_total;
    await page.locator(".msg.assistant").last().locator("button.regen").click();
    await replyDone(page, before[3].id);
    const regen = await shown(page);
    check(regen.length === 4 && JSON.stringify(regen.slice(0, 3)) === JSON.stringify(before.slice(0, 3)) && regen[3].id !== before[3].id && regen[3].state === "done",
      "Regenerate keeps 4 messages and replaces the last reply (id " + before[3].id + " -> " + regen[3].id + ")");
    const want = hist.slice(0, 3).filter((x) => x.content).map((x) => ({ role: x.role, content: x.content }));
    check(requests.length === nReq + 1 && JSON.stringify(requests[nReq].messages) === JSON.stringify(want) && (await api("/metrics?format=json")).requests_total === total0 + 1,
      "Regenerate asks once more, with the history before the dropped reply");
    await shot(page, "ui-regenerated.png");

    // Edit the first message: everything after it goes, the reply is new.
    await page.locator(".msg.user").first().locator("button.edit").click();
    const box = page.locator(".msg.user").first().locator(".edit-box textarea");
    check(await box.inputValue() === message, "Edit opens the message's text in place");
    await box.fill("Say hello.");
    await shot(page, "ui-editing.png");
    await page.locator(".msg.user").first().locator("button.resend").click();
    await replyDone(page, regen[3].id);
    const edited = await shown(page);
    const oldIds = regen.map((x) => x.id);
    check(edited.length === 2 && edited[0].role === "user" && edited[0].text === "Say hello." && edited[0].id !== before[0].id && !oldIds.includes(edited[1].id) && edited[1].state === "done",
      "an edited first message replaces the conversation after it: " + JSON.stringify(edited.map((x) => x.role + ":" + x.id)));
    check(JSON.stringify(requests[requests.length - 1].messages) === JSON.stringify([{ role: "user", content: "Say hello." }]), "the edited message is asked without the dropped turns");
    await shot(page, "ui-edited.png");

    // Switch conversations, delete one.
    await page.locator('#chats li[data-id="seeded"] .title').click();
    const seeded = await shown(page);
    check(JSON.stringify(seeded.map((x) => x.id)) === JSON.stringify(["seeded-u", "seeded-a"]) && await page.locator("#chats li.current").getAttribute("data-id") === "seeded",
      "switching back shows the older conversation, highlighted");
    await shot(page, "ui-chat-list.png");
    await page.locator(`#chats li[data-id="${chat1}"] .title`).click();
    check(JSON.stringify(await shown(page)) === JSON.stringify(edited), "and switching again shows the other one as it was");
    await page.locator('#chats li[data-id="seeded"] button.del').click();
    check(await page.locator("#chats li").count() === entries && await page.locator('#chats li[data-id="seeded"]').count() === 0 && JSON.stringify(await shown(page)) === JSON.stringify(edited),
      "deleting a conversation removes its entry and leaves the current one");
    await page.reload();
    await page.waitForSelector("#log .msg");
    check(await page.locator('#chats li[data-id="seeded"]').count() === 0 && JSON.stringify(await shown(page)) === JSON.stringify(edited), "and it stays deleted after a reload");
    console.log("ui tests passed; screenshots in " + ART);
  } finally {
    await browser.close();
  }
}

main().catch((e) => { console.error(e.stack || String(e)); process.exit(1); });
