// The web page of `sluice serve` (api/webui.c serves it): a chat, the batch
// jobs at a glance and a server status panel, in plain JavaScript that calls
// the server's own endpoints only.
//
// Safety: text from the model (or from anyone) reaches the DOM through
// textContent and createTextNode only, never through the HTML parser; the
// Markdown renderer below builds elements itself, and a link keeps only an
// http(s) or mailto address (tests/test_webui.py checks this file for the
// calls that parse HTML). The page's Content-Security-Policy (script-src 'self') stands
// behind that.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const LS = {
    key: 'sluice.apiKey', convs: 'sluice.conversations', current: 'sluice.current', settings: 'sluice.settings',
  };

  // el('div', {class: 'x', title: 'y'}, child, 'text', ...): an element; strings become text nodes
  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === 'class') e.className = v;
      else if (k === 'text') e.textContent = v;
      else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? '' : String(v));
    }
    for (const c of children) if (c !== null && c !== undefined && c !== false) e.append(c);
    return e;
  }

  function loadJSON(key, dflt) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v === null ? dflt : v;
    } catch (e) {
      return dflt;
    }
  }

  function fmtNum(x, digits = 0) {
    return x === null || x === undefined || Number.isNaN(x) ? '—'
      : Number(x).toLocaleString(undefined, {maximumFractionDigits: digits, minimumFractionDigits: digits});
  }

  function fmtDuration(s) {
    if (!Number.isFinite(s) || s < 0) return '—';
    if (s < 1) return `${Math.round(s * 1000)} ms`;
    if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${Math.round(s % 60)}s`;
    return `${Math.floor(s / 3600)}h ${Math.round((s % 3600) / 60)}m`;
  }

  function fmtBytes(n) {
    if (n < 1024) return `${n} B`;
    if (n < 1 << 20) return `${(n / 1024).toFixed(1)} KB`;
    return `${(n / (1 << 20)).toFixed(1)} MB`;
  }

  // ---- the API: every /v1 call carries the key; a 401 asks for it ----------------------------------

  const apiKey = () => localStorage.getItem(LS.key) || '';

  async function api(path, opts = {}) {
    const headers = new Headers(opts.headers || {});
    const k = apiKey();
    if (k && path.startsWith('/v1/')) headers.set('Authorization', `Bearer ${k}`);
    const r = await fetch(path, {...opts, headers});
    // asked once per key: a refresh every 2 s must not bring back a dialog the user closed
    if (r.status === 401 && keyAsked !== k) {
      keyAsked = k;
      askKey(k ? 'The server refused this key.' : 'This server needs an API key (--api-key).');
    }
    return r;
  }
  let keyAsked = null;

  async function errorOf(r) {
    let msg = `${r.status} ${r.statusText}`;
    try {
      const j = await r.json();
      if (j && j.error && j.error.message) msg = `${r.status}: ${j.error.message}`;
    } catch (e) { /* not JSON: the status says it */ }
    return new Error(msg);
  }

  async function apiJSON(path, opts) {
    const r = await api(path, opts);
    if (!r.ok) throw await errorOf(r);
    return r.json();
  }

  function askKey(why) {
    const d = $('key-dialog');
    $('key-why').textContent = why ||
      'Sent as "Authorization: Bearer …" with every /v1 request and kept in this browser.';
    $('key-input').value = apiKey();
    if (!d.open) d.showModal();
    $('key-input').focus();
  }

  function setupKeyDialog() {
    $('key-button').addEventListener('click', () => askKey());
    $('key-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      const v = $('key-input').value.trim();
      if (v) localStorage.setItem(LS.key, v);
      else localStorage.removeItem(LS.key);
      keyAsked = null;
      $('key-dialog').close();
      refreshAll();
    });
    $('key-cancel').addEventListener('click', () => $('key-dialog').close());
    $('key-clear').addEventListener('click', () => {
      localStorage.removeItem(LS.key);
      $('key-input').value = '';
      $('key-dialog').close();
    });
  }

  // ---- Markdown, rendered into elements (never HTML text) ------------------------------------------

  function safeHref(url) {
    try {
      const u = new URL(url, location.href);
      return ['http:', 'https:', 'mailto:'].includes(u.protocol) ? u.href : null;
    } catch (e) {
      return null;
    }
  }

  // `code`, **bold**, __bold__, *italic*, _italic_, ~~strike~~, [text](url), bare http(s) links
  const INLINE = new RegExp([
    '(`+)([\\s\\S]*?[^`])\\1(?!`)',
    '\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*',
    '__(?=\\S)([\\s\\S]*?\\S)__',
    '\\*(?=[^\\s*])([^*]*?[^\\s*])\\*',
    '(?<![\\w])_(?=\\S)([^_]*?\\S)_(?![\\w])',
    '~~(?=\\S)([\\s\\S]*?\\S)~~',
    '\\[([^\\]\\n]+)\\]\\(\\s*<?([^)\\s>]+)>?(?:\\s+"[^"]*")?\\s*\\)',
    '(https?:\\/\\/[^\\s<>()]*[^\\s<>().,;:!?\'"])',
  ].join('|'), 'g');

  function inline(text, parent) {
    let last = 0;
    const addText = (t) => {
      // a single newline inside a paragraph is kept as a line break
      t.split('\n').forEach((part, i) => {
        if (i) parent.append(el('br'));
        if (part) parent.append(document.createTextNode(part));
      });
    };
    for (const m of text.matchAll(INLINE)) {
      addText(text.slice(last, m.index));
      last = m.index + m[0].length;
      if (m[1]) parent.append(el('code', {text: m[2].replace(/^ (.*) $/s, '$1')}));
      else if (m[3] !== undefined || m[4] !== undefined) inline(m[3] ?? m[4], parent.appendChild(el('strong')));
      else if (m[5] !== undefined || m[6] !== undefined) inline(m[5] ?? m[6], parent.appendChild(el('em')));
      else if (m[7] !== undefined) inline(m[7], parent.appendChild(el('del')));
      else if (m[8] !== undefined) {
        const href = safeHref(m[9]);
        if (href) inline(m[8], parent.appendChild(el('a', {href, target: '_blank', rel: 'noopener noreferrer'})));
        else addText(m[0]);
      } else if (m[10] !== undefined) {
        const href = safeHref(m[10]);
        parent.append(href ? el('a', {href, target: '_blank', rel: 'noopener noreferrer', text: m[10]})
          : document.createTextNode(m[10]));
      }
    }
    addText(text.slice(last));
  }

  function copyText(text, button) {
    const done = () => {
      if (!button) return;
      const was = button.textContent;
      button.textContent = 'Copied';
      setTimeout(() => { button.textContent = was; }, 1200);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => copyFallback(text, done));
    } else {
      copyFallback(text, done);
    }
  }

  function copyFallback(text, done) { // plain http on another host: no clipboard API
    const t = el('textarea', {class: 'offscreen'});
    t.value = text;
    document.body.append(t);
    t.select();
    try { document.execCommand('copy'); done(); } catch (e) { /* nothing more to try */ }
    t.remove();
  }

  function codeBlock(lang, code) {
    const button = el('button', {type: 'button', class: 'ghost tiny', text: 'Copy'});
    button.addEventListener('click', () => copyText(code, button));
    return el('div', {class: 'code'},
      el('div', {class: 'code-head'}, el('span', {text: lang || 'code'}), button),
      el('pre', {}, el('code', {text: code})));
  }

  const RE = {
    fence: /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/,
    heading: /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/,
    hr: /^ {0,3}([-*_])(\s*\1){2,}\s*$/,
    quote: /^ {0,3}> ?(.*)$/,
    item: /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/,
    tableSep: /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/,
  };

  const cells = (line) => line.trim().replace(/^\|/, '').replace(/\|$/, '').split('|').map((c) => c.trim());

  function markdown(text, parent = document.createDocumentFragment()) {
    const lines = text.replace(/\r\n?/g, '\n').split('\n');
    let i = 0;
    const starts = (l) => RE.fence.test(l) || RE.heading.test(l) || RE.hr.test(l) || RE.quote.test(l) ||
      RE.item.test(l);
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) { i++; continue; }
      if ((m = RE.fence.exec(line))) { // a fence left open (a reply still streaming) runs to the end
        const fence = m[1];
        const body = [];
        for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
        i++;
        parent.append(codeBlock(m[2], body.join('\n')));
      } else if ((m = RE.heading.exec(line))) {
        inline(m[2], parent.appendChild(el(`h${Math.min(m[1].length + 2, 6)}`)));
        i++;
      } else if (RE.hr.test(line)) {
        parent.append(el('hr'));
        i++;
      } else if (RE.quote.test(line)) {
        const body = [];
        for (; i < lines.length && (m = RE.quote.exec(lines[i])); i++) body.push(m[1]);
        parent.append(markdown(body.join('\n'), el('blockquote')));
      } else if ((m = RE.item.exec(line))) {
        const ordered = /\d/.test(m[2]);
        const list = el(ordered ? 'ol' : 'ul');
        if (ordered && parseInt(m[2], 10) !== 1) list.setAttribute('start', String(parseInt(m[2], 10)));
        const indent = m[1].length;
        while (i < lines.length && (m = RE.item.exec(lines[i])) && m[1].length === indent &&
               /\d/.test(m[2]) === ordered) {
          const body = [m[3]];
          // the item's own lines: indented deeper, or a blank line followed by such
          for (i++; i < lines.length; i++) {
            const l = lines[i];
            const deeper = l.length - l.trimStart().length > indent;
            if (l.trim() && deeper) body.push(l.slice(Math.min(indent + 2, l.length - l.trimStart().length)));
            else if (!l.trim() && i + 1 < lines.length && lines[i + 1].trim() &&
                     lines[i + 1].length - lines[i + 1].trimStart().length > indent) body.push('');
            else break;
          }
          const li = el('li');
          if (body.length === 1) inline(body[0], li);
          else markdown(body.join('\n'), li);
          list.append(li);
          if (i < lines.length && !lines[i].trim()) i++; // a blank line between items
        }
        parent.append(list);
      } else if (line.includes('|') && i + 1 < lines.length && RE.tableSep.test(lines[i + 1])) {
        const table = el('table');
        const head = el('tr');
        cells(line).forEach((c) => inline(c, head.appendChild(el('th'))));
        table.append(el('thead', {}, head));
        const tbody = table.appendChild(el('tbody'));
        for (i += 2; i < lines.length && lines[i].includes('|') && lines[i].trim(); i++) {
          const tr = tbody.appendChild(el('tr'));
          cells(lines[i]).forEach((c) => inline(c, tr.appendChild(el('td'))));
        }
        parent.append(el('div', {class: 'table-wrap'}, table));
      } else {
        const body = [line];
        for (i++; i < lines.length && lines[i].trim() && !starts(lines[i]); i++) body.push(lines[i]);
        inline(body.join('\n'), parent.appendChild(el('p')));
      }
    }
    return parent;
  }

  // ---- chat: conversations in localStorage ---------------------------------------------------------

  const chat = {
    convs: loadJSON(LS.convs, []),
    current: localStorage.getItem(LS.current),
    ctrl: null, // the AbortController of the reply streaming now
    models: [],
  };
  const settings = Object.assign({model: '', temperature: 0.7, max_tokens: 512}, loadJSON(LS.settings, {}));
  // a reply kept while it streamed (the page closed, or another save came mid-reply) ended there
  for (const c of chat.convs) {
    for (const m of c.messages || []) {
      if (m.streaming) {
        delete m.streaming;
        m.stopped = true;
      }
    }
  }

  const newId = () => `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 7)}`;

  function saveConvs() {
    try {
      localStorage.setItem(LS.convs, JSON.stringify(chat.convs));
      localStorage.setItem(LS.current, chat.current || '');
    } catch (e) {
      console.warn('cannot keep the conversations', e); // over the storage quota: they live until the page closes
    }
  }

  function currentConv() {
    let c = chat.convs.find((x) => x.id === chat.current);
    if (!c) {
      c = {id: newId(), title: 'New chat', system: '', messages: [], updated: Date.now()};
      chat.convs.unshift(c);
      chat.current = c.id;
    }
    return c;
  }

  function renderConvList() {
    const ul = $('conv-list');
    ul.replaceChildren();
    for (const c of chat.convs) {
      const del = el('button', {type: 'button', class: 'ghost tiny', title: 'Delete this conversation', text: '✕'});
      del.addEventListener('click', (ev) => {
        ev.stopPropagation();
        if (chat.ctrl && c.id === chat.current) return;
        chat.convs = chat.convs.filter((x) => x !== c);
        if (chat.current === c.id) chat.current = chat.convs.length ? chat.convs[0].id : null;
        saveConvs();
        renderChat();
      });
      const li = el('li', {class: c.id === chat.current ? 'active' : '', title: c.title},
        el('span', {class: 'conv-title', text: c.title || 'New chat'}), del);
      li.addEventListener('click', () => {
        if (chat.ctrl) return; // one reply at a time
        chat.current = c.id;
        saveConvs();
        renderChat();
      });
      ul.append(li);
    }
  }

  function statsLine(s) {
    const parts = [];
    if (s.prompt_tokens !== undefined) parts.push(`prompt ${s.prompt_tokens}`);
    if (s.completion_tokens !== undefined) parts.push(`completion ${s.completion_tokens}`);
    else if (s.chunks) parts.push(`~${s.chunks} tokens`);
    if (s.cached_tokens !== undefined) parts.push(`cached ${s.cached_tokens}`);
    if (s.ttft_ms !== undefined) parts.push(`TTFT ${fmtDuration(s.ttft_ms / 1000)}`);
    if (s.tok_s) parts.push(`${s.tok_s.toFixed(1)} tok/s`);
    if (s.finish_reason === 'length') parts.push('cut at max tokens');
    else if (s.finish_reason && s.finish_reason !== 'stop') parts.push(s.finish_reason);
    return parts.join(' · ');
  }

  // The nodes of one message; fill() redraws its content (reasoning, answer, stats).
  function messageView(conv, msg, index) {
    const body = el('div', {class: 'content'});
    const reasoningBody = el('div', {class: 'reasoning-body'});
    const reasoningSummary = el('summary', {text: 'Reasoning'});
    const reasoning = el('details', {class: 'reasoning', hidden: true}, reasoningSummary, reasoningBody);
    const stats = el('div', {class: 'stats'});
    const actions = el('div', {class: 'actions'});
    const copy = el('button', {type: 'button', class: 'ghost tiny', text: 'Copy'});
    copy.addEventListener('click', () => copyText(msg.content, copy));
    actions.append(copy);
    const last = index === conv.messages.length - 1;
    if (msg.role === 'assistant' && last) {
      const regen = el('button', {type: 'button', class: 'ghost tiny regenerate', text: 'Regenerate'});
      regen.addEventListener('click', () => { if (!chat.ctrl) regenerate(); });
      actions.append(regen);
    }
    const node = el('div', {class: `msg ${msg.role}`},
      el('div', {class: 'msg-head'}, el('span', {class: 'role', text: msg.role === 'user' ? 'You' : 'Assistant'}),
        actions),
      msg.role === 'assistant' ? reasoning : null, body, stats);
    const fill = () => {
      if (msg.reasoning) {
        reasoning.hidden = false;
        reasoningSummary.textContent = msg.streaming && !msg.content ? 'Reasoning…'
          : `Reasoning (${msg.reasoning.length.toLocaleString()} characters)`;
        reasoningBody.replaceChildren(markdown(msg.reasoning));
      }
      if (msg.role === 'user') body.replaceChildren(el('p', {class: 'plain', text: msg.content}));
      else body.replaceChildren(markdown(msg.content));
      if (msg.streaming) { // the cursor at the end of the text as it grows
        const tail = body.lastElementChild;
        (tail && tail.tagName === 'P' ? tail : body).append(el('span', {class: 'cursor'}));
      }
      const flags = [];
      if (msg.stopped) flags.push(el('span', {class: 'pill warn', text: 'stopped'}));
      if (msg.error) flags.push(el('span', {class: 'pill bad', text: msg.error}));
      stats.replaceChildren(...flags, msg.stats ? statsLine(msg.stats) : '');
      node.classList.toggle('streaming', !!msg.streaming);
    };
    fill();
    return {node, fill};
  }

  function renderMessages() {
    const conv = currentConv();
    const box = $('messages');
    box.replaceChildren();
    if (!conv.messages.length) box.append($('empty-chat').content.cloneNode(true));
    conv.messages.forEach((m, i) => box.append(messageView(conv, m, i).node));
    box.scrollTop = box.scrollHeight;
  }

  function renderChat() {
    const conv = currentConv();
    $('system').value = conv.system || '';
    renderConvList();
    renderMessages();
    updateSettingsSummary();
  }

  function updateSettingsSummary() {
    const conv = currentConv();
    $('settings-summary').textContent = `${settings.model || '…'} · temperature ${settings.temperature} · ` +
      `max ${settings.max_tokens} tokens${conv.system ? ' · system prompt' : ''}`;
  }

  function setStreaming(on) {
    $('send').disabled = on;
    $('stop').disabled = !on;
    document.body.classList.toggle('is-streaming', on);
  }

  // Streams one assistant reply to the conversation as it stands.
  async function generate() {
    const conv = currentConv();
    const history = conv.messages.filter((m) => !m.error || m.content).map((m) => ({role: m.role, content: m.content}));
    if (conv.system && conv.system.trim()) history.unshift({role: 'system', content: conv.system});
    const msg = {role: 'assistant', content: '', reasoning: '', streaming: true};
    conv.messages.push(msg);
    conv.updated = Date.now();
    renderConvList();
    renderMessages();
    const box = $('messages');
    const view = messageView(conv, msg, conv.messages.length - 1);
    box.lastElementChild.replaceWith(view.node);
    let pending = false;
    const redraw = () => { // at most once a frame, however fast the tokens come
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        pending = false;
        const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
        view.fill();
        if (atBottom) box.scrollTop = box.scrollHeight;
      });
    };
    const ctrl = new AbortController();
    chat.ctrl = ctrl;
    setStreaming(true);
    const body = {
      model: settings.model || undefined, messages: history, stream: true, stream_options: {include_usage: true},
      temperature: Number(settings.temperature), max_tokens: Number(settings.max_tokens),
    };
    const t0 = performance.now();
    let tFirst = 0;
    let tLast = 0;
    let chunks = 0;
    let usage = null;
    let finish = null;
    const onData = (data) => {
      if (data === '[DONE]') return;
      const j = JSON.parse(data);
      if (j.error) throw new Error(j.error.message || 'error');
      if (j.usage) usage = j.usage;
      const ch = j.choices && j.choices[0];
      if (!ch) return;
      const d = ch.delta || {};
      const r = d.reasoning_content ?? d.reasoning;
      if (d.content || r) {
        tLast = performance.now();
        if (!tFirst) tFirst = tLast;
        chunks++;
      }
      if (r) msg.reasoning += r;
      if (d.content) msg.content += d.content;
      if (ch.finish_reason) finish = ch.finish_reason;
      redraw();
    };
    try {
      const r = await api('/v1/chat/completions', {
        method: 'POST', headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body), signal: ctrl.signal,
      });
      if (!r.ok) throw await errorOf(r);
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = '';
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += dec.decode(value, {stream: true});
        let nl;
        while ((nl = buf.indexOf('\n')) >= 0) {
          const line = buf.slice(0, nl).replace(/\r$/, '');
          buf = buf.slice(nl + 1);
          if (line.startsWith('data:')) onData(line.slice(5).trim());
        }
      }
    } catch (e) {
      if (e.name === 'AbortError') msg.stopped = true;
      else msg.error = e.message || String(e);
    }
    const s = {chunks};
    if (usage) {
      s.prompt_tokens = usage.prompt_tokens;
      s.completion_tokens = usage.completion_tokens;
      const det = usage.prompt_tokens_details;
      if (det && det.cached_tokens !== undefined && det.cached_tokens !== null) s.cached_tokens = det.cached_tokens;
    }
    if (tFirst) {
      s.ttft_ms = tFirst - t0;
      const n = usage ? usage.completion_tokens : chunks;
      if (n > 1 && tLast > tFirst) s.tok_s = (n - 1) / ((tLast - tFirst) / 1000);
    }
    if (finish) s.finish_reason = finish;
    msg.stats = s;
    delete msg.streaming;
    chat.ctrl = null;
    setStreaming(false);
    conv.updated = Date.now();
    saveConvs();
    renderMessages();
  }

  async function sendPrompt() {
    const text = $('prompt').value;
    if (!text.trim() || chat.ctrl) return;
    const conv = currentConv();
    conv.messages.push({role: 'user', content: text});
    if (conv.messages.filter((m) => m.role === 'user').length === 1) conv.title = text.trim().slice(0, 48);
    $('prompt').value = '';
    saveConvs();
    await generate();
  }

  function regenerate() {
    const conv = currentConv();
    while (conv.messages.length && conv.messages[conv.messages.length - 1].role === 'assistant') conv.messages.pop();
    if (!conv.messages.length) return;
    generate();
  }

  async function loadModels() {
    const sel = $('model');
    try {
      const j = await apiJSON('/v1/models');
      chat.models = (j.data || []).map((m) => m.id);
    } catch (e) {
      chat.models = [];
    }
    sel.replaceChildren(...chat.models.map((id) => el('option', {value: id, text: id})));
    if (!chat.models.includes(settings.model)) settings.model = chat.models[0] || '';
    sel.value = settings.model;
    updateSettingsSummary();
  }

  function setupChat() {
    $('temperature').value = settings.temperature;
    $('max-tokens').value = settings.max_tokens;
    const keep = () => {
      settings.model = $('model').value;
      const t = parseFloat($('temperature').value);
      const n = parseInt($('max-tokens').value, 10);
      if (Number.isFinite(t) && t >= 0) settings.temperature = t;
      if (Number.isFinite(n) && n > 0) settings.max_tokens = n;
      localStorage.setItem(LS.settings, JSON.stringify(settings));
      updateSettingsSummary();
    };
    for (const id of ['model', 'temperature', 'max-tokens']) $(id).addEventListener('change', keep);
    $('system').addEventListener('input', () => {
      currentConv().system = $('system').value;
      saveConvs();
      updateSettingsSummary();
    });
    $('composer').addEventListener('submit', (ev) => {
      ev.preventDefault();
      sendPrompt();
    });
    $('prompt').addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        sendPrompt();
      }
    });
    // aborting the fetch closes its connection: the server stops the request and frees its KV
    $('stop').addEventListener('click', () => { if (chat.ctrl) chat.ctrl.abort(); });
    $('new-chat').addEventListener('click', () => {
      if (chat.ctrl) return;
      const c = currentConv();
      if (c.messages.length) {
        chat.current = null;
        currentConv();
      }
      saveConvs();
      renderChat();
      $('prompt').focus();
    });
    window.addEventListener('storage', (ev) => { // another tab changed the conversations
      if (ev.key === LS.convs && !chat.ctrl) {
        chat.convs = loadJSON(LS.convs, []);
        renderChat();
      }
    });
    renderChat();
  }

  // ---- batches ---------------------------------------------------------------------------------------

  const batches = {
    file: null,   // the uploaded file object ({id, filename, bytes})
    limit: 20,
    history: {},  // batch id -> [[seconds, done], ...]: the rate over the last half minute
    timer: null,
  };

  function batchMsg(text, bad) {
    const m = $('batch-msg');
    m.textContent = text;
    m.classList.toggle('bad', !!bad);
  }

  // Reads the JSONL in the browser first: the line count, and the first line that is not a request
  // (among the first CHECK_LINES: the server checks them all).
  const CHECK_LINES = 10000;
  function checkJsonl(text) {
    const lines = text.split('\n');
    let n = 0;
    let url = null;
    for (let i = 0; i < lines.length; i++) {
      if (!lines[i].trim()) continue;
      if (i >= CHECK_LINES) {
        n++;
        continue;
      }
      let j;
      try {
        j = JSON.parse(lines[i]);
      } catch (e) {
        return {error: `line ${i + 1} is not JSON (${e.message})`};
      }
      if (!j || typeof j !== 'object' || !j.custom_id || !j.body) {
        return {error: `line ${i + 1} needs "custom_id" and "body"`};
      }
      url = url || j.url;
      n++;
    }
    return n ? {n, url} : {error: 'the file has no requests'};
  }

  async function takeFile(file) {
    if (!file) return;
    batches.file = null;
    $('batch-create').disabled = true;
    const info = $('upload-info');
    info.hidden = false;
    info.replaceChildren(el('b', {text: file.name}), ` — ${fmtBytes(file.size)}`);
    const check = checkJsonl(await file.text());
    if (check.error) {
      batchMsg(`Not a batch file: ${check.error}`, true);
      return;
    }
    info.append(`, ${check.n} request${check.n === 1 ? '' : 's'}`);
    if (check.url && [...$('batch-endpoint').options].some((o) => o.value === check.url)) {
      $('batch-endpoint').value = check.url;
    }
    batchMsg('Uploading…');
    const fd = new FormData();
    fd.append('purpose', 'batch');
    fd.append('file', file, file.name);
    try {
      const f = await apiJSON('/v1/files', {method: 'POST', body: fd});
      batches.file = {id: f.id, filename: f.filename || file.name, n: check.n};
      info.append(el('span', {class: 'muted', text: ` · uploaded as ${f.id}`}));
      $('batch-create').disabled = false;
      batchMsg('Ready: start the batch.');
    } catch (e) {
      batchMsg(`Upload failed: ${e.message}`, true);
    }
  }

  async function createBatch() {
    if (!batches.file) return;
    $('batch-create').disabled = true;
    try {
      const b = await apiJSON('/v1/batches', {
        method: 'POST', headers: {'Content-Type': 'application/json'},
        body: JSON.stringify({
          input_file_id: batches.file.id, endpoint: $('batch-endpoint').value,
          completion_window: $('batch-window').value.trim() || '24h', metadata: {filename: batches.file.filename},
        }),
      });
      batchMsg(`Started ${b.id}.`);
      batches.file = null;
      $('upload-info').hidden = true;
      $('file-input').value = '';
      refreshBatches();
    } catch (e) {
      batchMsg(`Cannot start the batch: ${e.message}`, true);
      $('batch-create').disabled = false;
    }
  }

  async function download(fileId, name, button) {
    const was = button.textContent;
    button.disabled = true;
    button.textContent = '…';
    try {
      const r = await api(`/v1/files/${encodeURIComponent(fileId)}/content`);
      if (!r.ok) throw await errorOf(r);
      const url = URL.createObjectURL(await r.blob());
      const a = el('a', {href: url, download: name, hidden: true});
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60000);
    } catch (e) {
      batchMsg(`Download failed: ${e.message}`, true);
    }
    button.disabled = false;
    button.textContent = was;
  }

  const ACTIVE = ['validating', 'in_progress', 'finalizing', 'cancelling'];

  // requests a second: over the samples of the last half minute, else since the batch began
  function batchRate(b, done, now) {
    const h = batches.history[b.id] || (batches.history[b.id] = []);
    if (!h.length || h[h.length - 1][1] !== done || ACTIVE.includes(b.status)) h.push([now, done]);
    while (h.length > 2 && now - h[0][0] > 30) h.shift();
    const end = b.completed_at || b.cancelled_at || b.failed_at || b.expired_at || b.finalizing_at;
    if (!ACTIVE.includes(b.status) || b.status === 'finalizing') {
      const t = (end || now) - (b.in_progress_at || b.created_at);
      return t > 0 && done ? done / t : null;
    }
    const [t0, d0] = h[0];
    if (now - t0 >= 4 && done > d0) return (done - d0) / (now - t0);
    const t = now - (b.in_progress_at || now);
    return t > 0 && done ? done / t : null;
  }

  function progressBar(done, failed, total) {
    const pct = (x) => `${total ? (100 * x) / total : 0}%`;
    const ok = el('div', {class: 'fill'});
    ok.style.width = pct(done);
    const bad = el('div', {class: 'fill bad'});
    bad.style.width = pct(failed);
    const p = total ? Math.round((100 * (done + failed)) / total) : 0;
    return el('div', {class: 'progress'},
      el('div', {class: 'bar', role: 'progressbar', 'aria-valuemin': 0, 'aria-valuemax': 100, 'aria-valuenow': p},
        ok, bad),
      el('div', {class: 'small', text: `${done + failed} / ${total || '?'}${failed ? ` (${failed} failed)` : ''} · ${p}%`}));
  }

  function batchRow(b, now) {
    const c = b.request_counts || {total: 0, completed: 0, failed: 0};
    const done = c.completed + c.failed;
    const rate = batchRate(b, done, now);
    const active = ACTIVE.includes(b.status);
    let eta = '—';
    if (active && b.status !== 'cancelling' && rate && c.total > done) {
      const s = (c.total - done) / rate;
      eta = `${fmtDuration(s)} (${new Date((now + s) * 1000).toLocaleTimeString()})`;
    } else if (b.completed_at && b.in_progress_at) {
      eta = `took ${fmtDuration(b.completed_at - b.in_progress_at)}`;
    }
    const actions = el('div', {class: 'row-actions'});
    const sig = [b.status, b.output_file_id, b.error_file_id].join(' ');
    if (['validating', 'in_progress', 'finalizing'].includes(b.status)) {
      const cancel = el('button', {type: 'button', class: 'ghost tiny danger-text', text: 'Cancel'});
      cancel.addEventListener('click', async () => {
        cancel.disabled = true;
        try {
          await apiJSON(`/v1/batches/${encodeURIComponent(b.id)}/cancel`, {method: 'POST'});
        } catch (e) {
          batchMsg(`Cannot cancel ${b.id}: ${e.message}`, true);
        }
        refreshBatches();
      });
      actions.append(cancel);
    }
    for (const [key, label, suffix] of [['output_file_id', 'Output', 'output'], ['error_file_id', 'Errors', 'errors']]) {
      if (!b[key]) continue;
      const btn = el('button', {type: 'button', class: 'ghost tiny', 'data-file': b[key], text: label});
      btn.addEventListener('click', () => download(b[key], `${b.id}_${suffix}.jsonl`, btn));
      actions.append(btn);
    }
    const name = b.metadata && typeof b.metadata.filename === 'string' ? b.metadata.filename : b.input_file_id;
    const created = b.created_at ? new Date(b.created_at * 1000).toLocaleString() : '';
    const errs = b.errors && b.errors.data ? b.errors.data.map((e) => `${e.line ? `line ${e.line}: ` : ''}${e.message}`) : [];
    return el('tr', {'data-batch': b.id, 'data-status': b.status, 'data-actions': sig},
      el('td', {}, el('div', {class: 'mono', text: b.id}),
        el('div', {class: 'muted small', text: `${name} · ${b.endpoint} · ${created}`}),
        errs.length ? el('div', {class: 'bad small', text: errs.slice(0, 3).join('; ')}) : null),
      el('td', {}, el('span', {class: `pill status-${b.status}`, text: b.status.replace('_', ' ')})),
      el('td', {}, progressBar(c.completed, c.failed, c.total)),
      el('td', {class: 'nowrap', text: rate ? `${rate < 10 ? rate.toFixed(2) : rate.toFixed(0)} req/s` : '—'}),
      el('td', {class: 'small nowrap', text: eta}),
      el('td', {}, actions));
  }

  // The new rows in place of the old; a row whose buttons are the same keeps its old buttons, so a
  // click is never lost to a refresh that replaced the button under the pointer.
  function swapRows(tbody, rows) {
    const old = new Map([...tbody.rows].map((r) => [r.dataset.batch, r]));
    for (const r of rows) {
      const o = old.get(r.dataset.batch);
      if (o && o.dataset.actions === r.dataset.actions) r.lastElementChild.replaceWith(o.lastElementChild);
    }
    tbody.replaceChildren(...rows);
  }

  async function refreshBatches() {
    try {
      const j = await apiJSON(`/v1/batches?limit=${batches.limit}`);
      const now = Date.now() / 1000;
      const rows = (j.data || []).map((b) => batchRow(b, now));
      swapRows($('batch-table').tBodies[0], rows);
      $('batch-empty').hidden = rows.length > 0;
      $('batch-more').hidden = !j.has_more;
    } catch (e) {
      $('batch-empty').hidden = false;
      $('batch-empty').textContent = `Cannot list the batches: ${e.message}`;
    }
  }

  function setupBatches() {
    const drop = $('drop');
    drop.addEventListener('dragover', (ev) => {
      ev.preventDefault();
      drop.classList.add('over');
    });
    drop.addEventListener('dragleave', () => drop.classList.remove('over'));
    drop.addEventListener('drop', (ev) => {
      ev.preventDefault();
      drop.classList.remove('over');
      takeFile(ev.dataTransfer && ev.dataTransfer.files[0]);
    });
    // a file dropped beside the zone is not opened by the browser in place of the page
    window.addEventListener('dragover', (ev) => ev.preventDefault());
    window.addEventListener('drop', (ev) => ev.preventDefault());
    $('file-input').addEventListener('change', (ev) => takeFile(ev.target.files[0]));
    $('batch-create').addEventListener('click', createBatch);
    $('batch-refresh').addEventListener('click', refreshBatches);
    $('batch-more').addEventListener('click', () => {
      batches.limit = Math.min(batches.limit * 2, 100);
      refreshBatches();
    });
  }

  // ---- server status ---------------------------------------------------------------------------------

  // Prometheus text: {name: [{labels: {...}, value}]}
  function parseMetrics(text) {
    const out = {};
    for (const line of text.split('\n')) {
      if (!line || line.startsWith('#')) continue;
      const m = /^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$/.exec(line);
      if (!m) continue;
      const labels = {};
      for (const l of (m[2] || '').matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
      (out[m[1]] = out[m[1]] || []).push({labels, value: parseFloat(m[3])});
    }
    return out;
  }

  const status = {prev: null};

  function stat(label, value, sub) {
    return el('div', {class: 'stat'}, el('div', {class: 'stat-label', text: label}),
      el('div', {class: 'stat-value', text: value}), sub ? el('div', {class: 'muted small', text: sub}) : null);
  }

  async function refreshHealth() {
    const dot = $('health-dot');
    try {
      const r = await fetch('/health');
      const t = await r.text();
      const degraded = r.ok && t.includes('degraded');
      dot.className = `dot ${!r.ok ? 'bad' : degraded ? 'warn' : 'ok'}`;
      dot.title = !r.ok ? `health: ${r.status}` : degraded ? 'degraded: the batch store cannot write' : 'healthy';
      return {ok: r.ok, status: r.status, degraded, text: t};
    } catch (e) {
      dot.className = 'dot bad';
      dot.title = 'the server does not answer';
      return {ok: false, status: 0, degraded: false};
    }
  }

  async function refreshServer() {
    const [models, metricsText, health, version] = await Promise.all([
      apiJSON('/v1/models').catch(() => null),
      fetch('/metrics').then((r) => (r.ok ? r.text() : '')).catch(() => ''),
      refreshHealth(),
      fetch('/version').then((r) => r.json()).catch(() => null),
    ]);
    const mx = parseMetrics(metricsText);
    const g = (name, labels) => {
      const s = (mx[`sluice:${name}`] || []).find((x) => !labels || Object.entries(labels).every(([k, v]) => x.labels[k] === v));
      return s ? s.value : null;
    };
    const info = ((mx['sluice:server_info'] || [])[0] || {}).labels || {};
    const now = Date.now() / 1000;
    const decoded = g('decode_tokens_total');
    let liveTok = null;
    if (status.prev && decoded !== null && now > status.prev.t) liveTok = (decoded - status.prev.decoded) / (now - status.prev.t);
    status.prev = {t: now, decoded};
    const ttftSum = g('time_to_first_token_seconds_sum', {class: 'interactive'});
    const ttftN = g('time_to_first_token_seconds_count', {class: 'interactive'});
    const m0 = models && models.data && models.data[0];
    const hit = g('prefix_cache_hit_rate');
    const usage = g('kv_cache_usage_perc');
    const tp = info.tensor_parallel_size;
    const grid = [
      stat('Model', m0 ? models.data.map((m) => m.id).join(', ') : '—', m0 ? m0.root : 'needs the API key?'),
      stat('Context', m0 ? `${fmtNum(m0.max_model_len)} tokens` : '—', 'max-model-len'),
      stat('Backend', info.backend || '—',
        info.backend === 'cuda' ? `${tp} GPU${tp === '1' ? '' : 's'} per model` : info.backend ? 'no GPU' : ''),
      stat('Health', health.ok ? (health.degraded ? 'degraded' : 'ok') : health.status === 503 ? 'loading' : 'down',
        version ? `sluice ${version.version}` : ''),
      stat('Requests', `${fmtNum(g('num_requests_running'))} running`, `${fmtNum(g('num_requests_waiting'))} waiting`),
      stat('KV cache', usage === null ? '—' : `${(100 * usage).toFixed(1)}% used`,
        `${fmtNum(g('kv_blocks_used'))} / ${fmtNum(g('kv_blocks_total'))} blocks, ${fmtNum(g('kv_blocks_cached'))} cached`),
      stat('Prefix cache', hit === null ? '—' : `${(100 * hit).toFixed(1)}% hit`,
        `${fmtNum(g('prefix_cache_hits_total'))} of ${fmtNum(g('prefix_cache_queries_total'))} prompt tokens`),
      stat('Decode', liveTok === null ? '—' : `${fmtNum(liveTok, 1)} tok/s`, `${fmtNum(decoded)} tokens since start`),
      stat('Batch work', `${fmtNum(g('batch_throughput_tokens_per_second'), 1)} tok/s`,
        g('batch_store_failing') ? 'the batch store cannot write' : `${fmtNum(g('batch_results_waiting'))} results waiting`),
      stat('Chat TTFT', ttftN ? fmtDuration(ttftSum / ttftN) : '—',
        `mean of ${fmtNum(ttftN)} request${ttftN === 1 ? '' : 's'}`),
      stat('Answered', fmtNum(g('request_success_total')), `${fmtNum(g('request_failure_total'))} refused or failed`),
      stat('Tokens', fmtNum(g('generation_tokens_total')), `generated, ${fmtNum(g('prompt_tokens_total'))} prompt`),
    ];
    $('srv-grid').replaceChildren(...grid);
    const bar = $('kv-bar');
    bar.style.width = `${usage ? 100 * usage : 0}%`;
    bar.parentElement.setAttribute('aria-valuenow', String(Math.round(100 * (usage || 0))));
    $('kv-text').textContent = usage === null ? '' : `${(100 * usage).toFixed(1)}% of the KV cache holds running requests`;
    $('srv-updated').textContent = `updated ${new Date().toLocaleTimeString()}`;
  }

  // ---- tabs and timers -------------------------------------------------------------------------------

  const VIEWS = ['chat', 'batches', 'server'];
  let view = 'chat';

  function showView() {
    const v = location.hash.slice(1);
    view = VIEWS.includes(v) ? v : 'chat';
    for (const name of VIEWS) {
      $(`view-${name}`).hidden = name !== view;
      $(`tab-${name}`).classList.toggle('active', name === view);
      $(`tab-${name}`).setAttribute('aria-selected', String(name === view));
    }
    if (view === 'batches') refreshBatches();
    if (view === 'server') refreshServer();
  }

  function tick() {
    if (document.hidden) return;
    if (!chat.models.length) loadModels(); // the model was still loading, or the key was missing
    if (view === 'batches' && $('batch-auto').checked) refreshBatches();
    if (view === 'server') refreshServer();
  }

  function refreshAll() {
    loadModels();
    refreshHealth();
    if (view === 'batches') refreshBatches();
    if (view === 'server') refreshServer();
  }

  function start() {
    setupKeyDialog();
    setupChat();
    setupBatches();
    window.addEventListener('hashchange', showView);
    showView();
    loadModels();
    refreshHealth();
    setInterval(tick, 2000);
    setInterval(refreshHealth, 10000);
  }

  start();
})();
