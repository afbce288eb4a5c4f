--[[
pinvault admission for Slurm (job_submit/lua, Slurm 22.05 or later): a batch job is accepted
only if the vault admits its pins, and an accepted job carries its run id.

The job's pins come from the environment sbatch exports with it:
  PINVAULT_IMAGE, PINVAULT_DATASET, PINVAULT_SEED  (required)
  PINVAULT_CONFIG_DIGEST, PINVAULT_RUN_ID          (optional; `vault run` sets the run id)
The team is the job's --account, or else the submitting user's name.

The decision is the vault's: the plugin asks the admission agent (`vault admission-agent`, a
warm client beside slurmctld) on its Unix socket when pinvault.conf names one and lua-socket is
installed, and otherwise runs `vault admit --porcelain`; then it either
  - accepts the job, writes "pinvault run=<run id> seed=<seed>" into its AdminComment (which
    only an administrator can change), sets PINVAULT_RUN_ID and PINVAULT_SEED in the job's
    environment and tells the user, on one line, the run and what the vault checked of the
    image ("image held: 7 blobs, each verified when stored"), or
  - refuses it, showing the user the vault's one-line reason. Anything else that goes wrong
    (no vault, no agent, no answer in time, an answer not understood, no configuration)
    refuses too: the plugin fails closed.

Its own settings are read from pinvault.conf next to this file; see slurm/README.md.
]]

local CONF_NAME = "pinvault.conf"
local DEFAULTS = { vault = "vault", timeout = "5", path = "/usr/local/bin:/usr/bin:/bin" }
local KEYS = {
	vault = true, client_config = true, state_dir = true, timeout = true, path = true, agent = true,
}

-- This file's folder: Slurm loads job_submit.lua from the folder slurm.conf is in, and the
-- plugin's own configuration sits beside it.
local function plugin_dir()
	local source = debug.getinfo(1, "S").source
	return source:match("^@(.*)/[^/]*$") or "/etc/slurm"
end

-- "key = value" lines; '#' starts a comment. Read on every submission (a few hundred bytes)
-- so that an edit takes effect without restarting slurmctld.
local function read_conf()
	local path = plugin_dir() .. "/" .. CONF_NAME
	local file, err = io.open(path, "r")
	if not file then
		return nil, "cannot read " .. path .. ": " .. tostring(err)
	end
	local conf = {}
	for key, value in pairs(DEFAULTS) do
		conf[key] = value
	end
	local number = 0
	for line in file:lines() do
		number = number + 1
		line = line:gsub("#.*$", ""):match("^%s*(.-)%s*$")
		if line ~= "" then
			local key, value = line:match("^([%w_]+)%s*=%s*(.-)$")
			if not key then
				file:close()
				return nil, path .. ":" .. number .. ": expected key = value"
			end
			-- A misspelt key would otherwise leave its default in force unnoticed.
			if not KEYS[key] then
				file:close()
				return nil, path .. ":" .. number .. ": unknown key " .. key
			end
			conf[key] = value
		end
	end
	file:close()
	-- The agent has its own client configuration; the vault command needs this one.
	if (not conf.client_config or conf.client_config == "") and not conf.agent then
		return nil, path .. ": client_config is not set"
	end
	if conf.agent == "" then
		return nil, path .. ": agent names no socket"
	end
	if not tonumber(conf.timeout) then
		return nil, path .. ": timeout must be a number of seconds"
	end
	return conf
end

-- Every value that reaches the shell is quoted: pins and account names come from the user,
-- and slurmctld runs this as SlurmUser.
local function quote(value)
	return "'" .. (string.gsub(value, "'", "'\\''")) .. "'"
end

-- A refusal on the job's own merits reads "Access/permission denied" after the reason; when
-- the vault could not be asked, the job may be fine, and Slurm's generic error says so less.
local function refuse(reason)
	slurm.log_user("pinvault: job refused: %s", reason)
	slurm.log_info("pinvault: job refused: %s", reason)
	if reason:match("^UNAVAILABLE:") or reason:match("^admission is misconfigured") then
		return slurm.ERROR
	end
	return slurm.ESLURM_ACCESS_DENIED
end

-- What the vault checked of the job's image, in the words `vault run` uses, from the count of
-- its blobs found held (a string of digits) and whether it is external; nil when the answer does
-- not say (a vault older than this plugin) or says it in a form not understood.
local function image_checked(count, external)
	local blobs = type(count) == "string" and count:match("^%d+$") and #count <= 15
		and tonumber(count) or nil
	if external == true then
		return "image recorded, not fetched (external)"
	elseif external ~= false or blobs == nil then
		return nil
	elseif blobs == 1 then
		return "image held: 1 blob, verified when stored"
	elseif blobs > 1 then
		return "image held: " .. blobs .. " blobs, each verified when stored"
	end
	return "image held: one file, verified when stored"
end

-- Runs `vault admit`; returns what it admitted ({run_id, seed, image}), or nil and the reason
-- to show the user.
local function admit_by_command(conf, pins)
	-- `env -i`: nothing of slurmctld's own environment (a PINVAULT_* variable, a HOME with
	-- no trust state) may change which vault is asked or how it is trusted.
	local env = { "env", "-i", "PATH=" .. quote(conf.path), "LANG=C.UTF-8",
		"PINVAULT_CONFIG=" .. quote(conf.client_config) }
	if conf.state_dir then
		-- The client keeps the vault's last verified checkpoint here (XDG_STATE_HOME).
		table.insert(env, "XDG_STATE_HOME=" .. quote(conf.state_dir))
	end
	-- The whole submission waits on this call with slurmctld's job lock held, and sbatch
	-- gives up after MessageTimeout (10 s by default): bound it well below that.
	local args = { "timeout", "-k", "1", quote(conf.timeout), quote(conf.vault), "admit",
		"--porcelain",
		"--image=" .. quote(pins.image),
		"--dataset=" .. quote(pins.dataset),
		"--seed=" .. quote(pins.seed),
		"--team=" .. quote(pins.team) }
	if pins.config then
		table.insert(args, "--config=" .. quote(pins.config))
	end
	if pins.run_id then
		table.insert(args, "--run-id=" .. quote(pins.run_id))
	end
	-- Lua 5.1 (which Slurm links) cannot read a child's exit status from io.popen, so the
	-- shell prints it as the last line.
	local command = table.concat(env, " ") .. " " .. table.concat(args, " ")
		.. " </dev/null 2>&1; echo \"exit=$?\""
	local pipe = io.popen(command, "r")
	if not pipe then
		return nil, "cannot run " .. conf.vault
	end
	local output = pipe:read("*a")
	pipe:close()

	local lines = {}
	for line in output:gmatch("[^\n]+") do
		table.insert(lines, line)
	end
	local status = tonumber((table.remove(lines) or ""):match("^exit=(%d+)$"))
	if status == 0 then
		-- The run and seed on one line, what was checked of the image on the next (a vault
		-- older than this plugin prints the first alone).
		local admitted, blobs, external
		for _, line in ipairs(lines) do
			local run_id, seed = line:match("^run_id=(sha256:%x+) seed=(%d+)$")
			if run_id and not admitted then
				admitted = { run_id = run_id, seed = seed }
			end
			local count, word = line:match("^image_blobs=(%d+) image_external=(%a+)$")
			if count then
				blobs, external = count, ({ ["true"] = true, ["false"] = false })[word]
			end
		end
		if admitted then
			admitted.image = image_checked(blobs, external)
			return admitted
		end
		return nil, "the vault admitted the job but its answer was not understood: "
			.. table.concat(lines, " | ")
	end
	-- The vault's refusals and its UNAVAILABLE are one line "vault: STATUS: reason".
	for i = #lines, 1, -1 do
		local reason = lines[i]:match("^vault: (.*)$")
		if reason then
			return nil, reason
		end
	end
	if status == 124 or status == 137 then
		return nil, "UNAVAILABLE: no answer from the vault in " .. conf.timeout .. " s"
	elseif status == 126 or status == 127 then
		return nil, "the vault command " .. conf.vault .. " cannot be run on the controller"
	end
	return nil, "the vault command failed (exit " .. tostring(status) .. "): "
		.. (lines[#lines] or "no output")
end

-- lua-socket (Debian: lua-socket), loaded at the first submission that names an agent; nil
-- when it is not installed, and then the vault command is asked instead.
local unix_sockets, socket_core, sockets_missing

local function load_sockets()
	if unix_sockets == nil and sockets_missing == nil then
		local ok_unix, unix = pcall(require, "socket.unix")
		local ok_core, core = pcall(require, "socket.core")
		if ok_unix and ok_core then
			unix_sockets, socket_core = unix, core
		else
			sockets_missing = tostring(ok_unix and core or unix):gsub("%s+", " ")
			slurm.log_info("pinvault: lua-socket cannot be loaded, so admissions run the vault "
				.. "command instead of asking the agent: %s", sockets_missing)
		end
	end
	return unix_sockets
end

-- The agent reads one line of JSON. Pins come from the user: every quote, backslash and
-- control character is escaped, so a value cannot end its string or the line.
local JSON_NAMED = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

local function json_string(value)
	local escaped = value:gsub('[%c"\\]', function(c)
		return JSON_NAMED[c] or string.format("\\u%04x", c:byte())
	end)
	return '"' .. escaped .. '"'
end

local function agent_request(pins)
	local fields = {}
	for _, name in ipairs({ "image", "dataset", "config", "seed", "team", "run_id" }) do
		if pins[name] then
			table.insert(fields, json_string(name) .. ":" .. json_string(pins[name]))
		end
	end
	return "{" .. table.concat(fields, ",") .. "}\n"
end

local JSON_UNESCAPED = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n",
	r = "\r", t = "\t" }

local function utf8_char(code)
	if code < 0x80 then
		return string.char(code)
	elseif code < 0x800 then
		return string.char(0xC0 + math.floor(code / 0x40), 0x80 + code % 0x40)
	elseif code < 0x10000 then
		return string.char(0xE0 + math.floor(code / 0x1000), 0x80 + math.floor(code / 0x40) % 0x40,
			0x80 + code % 0x40)
	end
	return string.char(0xF0 + math.floor(code / 0x40000), 0x80 + math.floor(code / 0x1000) % 0x40,
		0x80 + math.floor(code / 0x40) % 0x40, 0x80 + code % 0x40)
end

-- The JSON string that starts at text[pos] (its opening quote): its value and the position
-- after it, or nil.
local function read_string(text, pos)
	local out = {}
	local i = pos + 1
	while true do
		local c = text:sub(i, i)
		if c == "" then
			return nil
		elseif c == '"' then
			return table.concat(out), i + 1
		elseif c == "\\" then
			local e = text:sub(i + 1, i + 1)
			if e == "u" then
				local hex = text:match("^%x%x%x%x", i + 2)
				if not hex then
					return nil
				end
				local code = tonumber(hex, 16)
				i = i + 6
				if code >= 0xD800 and code < 0xDC00 then
					local low = tonumber(text:match("^\\u(%x%x%x%x)", i) or "", 16)
					if low and low >= 0xDC00 and low < 0xE000 then
						code = 0x10000 + (code - 0xD800) * 0x400 + (low - 0xDC00)
						i = i + 6
					else
						code = 0xFFFD
					end
				elseif code >= 0xDC00 and code < 0xE000 then
					code = 0xFFFD
				end
				table.insert(out, utf8_char(code))
			elseif JSON_UNESCAPED[e] then
				table.insert(out, JSON_UNESCAPED[e])
				i = i + 2
			else
				return nil
			end
		else
			local run = text:match('^[^"\\]+', i)
			if run:find("[%z\1-\31]") then
				return nil
			end
			table.insert(out, run)
			i = i + #run
		end
	end
end

-- The agent's answer: one JSON object whose values are strings or booleans, or nil.
local function decode_answer(text)
	local answer = {}
	local pos = text:match("^%s*{%s*()")
	if not pos then
		return nil
	end
	if text:match("^}%s*$", pos) then
		return answer
	end
	while true do
		if text:sub(pos, pos) ~= '"' then
			return nil
		end
		local key, value
		key, pos = read_string(text, pos)
		pos = key and text:match("^%s*:%s*()", pos)
		if not pos then
			return nil
		end
		if text:sub(pos, pos) == '"' then
			value, pos = read_string(text, pos)
			if value == nil then
				return nil
			end
		else
			local word, after = text:match("^(%a+)()", pos)
			if word ~= "true" and word ~= "false" then
				return nil
			end
			value, pos = word == "true", after
		end
		answer[key] = value
		local separator, after = text:match("^%s*([,}])%s*()", pos)
		if separator == "}" then
			return after == #text + 1 and answer or nil
		elseif separator ~= "," then
			return nil
		end
		pos = after
	end
end

-- Asks the admission agent; returns what it admitted ({run_id, seed, image}), or nil and the
-- reason to show the user.
-- The whole exchange shares one deadline, as the vault command's does.
local function admit_by_agent(conf, pins, unix)
	local deadline = socket_core.gettime() + tonumber(conf.timeout)
	local function left()
		return math.max(deadline - socket_core.gettime(), 0)
	end
	local where = "the admission agent at " .. conf.agent
	local client, err = unix.stream()
	if not client then
		return nil, "UNAVAILABLE: no socket to ask " .. where .. ": " .. tostring(err)
	end
	local function failed(reason)
		client:close()
		return nil, reason
	end
	client:settimeout(left(), "t")
	local ok
	ok, err = client:connect(conf.agent)
	if not ok then
		return failed("UNAVAILABLE: " .. where .. " cannot be reached: " .. tostring(err))
	end
	client:settimeout(left(), "t")
	ok, err = client:send(agent_request(pins))
	if not ok then
		return failed("UNAVAILABLE: " .. where .. " took no request: " .. tostring(err))
	end
	client:settimeout(left(), "t")
	local line
	line, err = client:receive("*l")
	client:close()
	if not line then
		if err == "timeout" then
			return nil, "UNAVAILABLE: no answer from " .. where .. " in " .. conf.timeout .. " s"
		end
		return nil, "UNAVAILABLE: " .. where .. " closed the connection without an answer"
	end
	local answer = decode_answer(line)
	if answer and answer.admitted == true and type(answer.run_id) == "string"
		and type(answer.seed) == "string" and answer.run_id:match("^sha256:" .. string.rep("%x", 64) .. "$")
		and answer.seed:match("^%d+$") then
		return { run_id = answer.run_id, seed = answer.seed,
			image = image_checked(answer.image_blobs, answer.image_external) }
	end
	if answer and answer.admitted == false and type(answer.reason) == "string"
		and answer.reason:match("%S") then
		-- The vault's one-line reason, word for word (it never holds a line break).
		return nil, (answer.reason:gsub("%s+", " "))
	end
	return nil, where .. " gave an answer that was not understood: " .. line:sub(1, 200)
end

-- The agent when one is named and lua-socket is there; the vault command otherwise.
local function admit(conf, pins)
	local unix = conf.agent and load_sockets()
	if unix then
		return admit_by_agent(conf, pins, unix)
	end
	if not conf.client_config or conf.client_config == "" then
		return nil, "admission is misconfigured on the controller: lua-socket cannot be loaded "
			.. "to ask the agent, and pinvault.conf sets no client_config for the vault command"
	end
	return admit_by_command(conf, pins)
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	-- Only a batch job carries an environment at submission (srun and salloc send none), so
	-- only a batch job can carry pins.
	if job_desc.script == nil then
		return refuse("only batch jobs can carry pins: submit with sbatch "
			.. "(PINVAULT_IMAGE, PINVAULT_DATASET, PINVAULT_SEED in its environment)")
	end
	local environment = job_desc.environment or {}
	local pins = {
		image = environment.PINVAULT_IMAGE,
		dataset = environment.PINVAULT_DATASET,
		seed = environment.PINVAULT_SEED,
		config = environment.PINVAULT_CONFIG_DIGEST,
		run_id = environment.PINVAULT_RUN_ID,
		team = job_desc.account or job_desc.user_name or tostring(submit_uid),
	}
	local missing = {}
	for _, name in ipairs({ "image", "dataset", "seed" }) do
		if pins[name] == nil or pins[name] == "" then
			table.insert(missing, "PINVAULT_" .. string.upper(name))
		end
	end
	if #missing > 0 then
		return refuse("the job carries no pins (" .. table.concat(missing, ", ")
			.. " not set): export the image and dataset digests and the seed, or submit "
			.. "with `vault run`")
	end

	local conf, err = read_conf()
	if not conf then
		return refuse("admission is misconfigured on the controller: " .. err)
	end
	local admitted, reason = admit(conf, pins)
	if not admitted then
		return refuse(reason)
	end
	local run_id = admitted.run_id
	local record = "pinvault run=" .. run_id .. " seed=" .. admitted.seed
	if job_desc.admin_comment and job_desc.admin_comment ~= "" then
		record = record .. "; " .. job_desc.admin_comment
	end
	job_desc.admin_comment = record
	-- In 22.05 the environment table writes through to the job's environment.
	job_desc.environment.PINVAULT_RUN_ID = run_id
	job_desc.environment.PINVAULT_SEED = admitted.seed
	-- One line on sbatch's standard error: what the vault checked, besides that it admitted.
	local told = "pinvault: admitted as run " .. run_id
	if admitted.image then
		told = told .. "; " .. admitted.image
	end
	slurm.log_user("%s", told)
	slurm.log_info("pinvault: job of %s admitted as run %s", pins.team, run_id)
	return slurm.SUCCESS
end

-- A job's environment cannot be changed once submitted, so its pins stay as admitted; its
-- account can, and the vault recorded that account as the run's team.
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	if job_desc.account ~= nil and job_desc.account ~= job_rec.account then
		slurm.log_user("pinvault: the account of job %s was its team when the vault admitted it "
			.. "and cannot change: submit again with --account=%s", tostring(job_rec.job_id),
			job_desc.account)
		return slurm.ESLURM_ACCESS_DENIED
	end
	return slurm.SUCCESS
end

return slurm.SUCCESS
