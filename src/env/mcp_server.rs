//! `envace env serve DOMAIN`: a built-in domain as an MCP server over stdio, so that other agents
//! and tools can act in our domains. The tool list is dynamic (it comes from the domain), so the
//! rmcp `ServerHandler` is implemented by hand rather than with the `#[tool]` macros. Domain tool
//! errors go back as `isError` results carrying `{"error": {code, message}}`, which our client
//! turns back into the same [`ToolResponse::Error`].

use std::sync::{Arc, Mutex};

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations as McpAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::Value;

use crate::env::{DomainEnv, EnvError, ToolResponse, ToolSpec};
use crate::message::ToolCall;

/// Our [`ToolSpec`] as an MCP tool, hints included.
pub fn to_mcp_tool(t: &ToolSpec) -> Tool {
    let schema = match &t.input_schema {
        Value::Object(m) => m.clone(),
        _ => serde_json::Map::new(),
    };
    let a = &t.annotations;
    Tool::new(t.name.clone(), t.description.clone(), schema).annotate(
        McpAnnotations::new()
            .read_only(a.read_only)
            .destructive(a.destructive)
            .idempotent(a.idempotent)
            .open_world(a.open_world),
    )
}

/// Our [`ToolResponse`] as an MCP result.
pub fn to_mcp_result(r: &ToolResponse) -> CallToolResult {
    match r {
        ToolResponse::Success { value } => CallToolResult::structured(value.clone()),
        ToolResponse::Error { .. } => CallToolResult::structured_error(r.to_json()),
    }
}

/// The rmcp handler around one live domain environment.
#[derive(Debug, Clone)]
pub struct DomainServer {
    env: Arc<Mutex<DomainEnv>>,
    tools: Vec<ToolSpec>,
}

impl DomainServer {
    pub fn new(env: DomainEnv) -> Self {
        let tools = env.domain().tools();
        Self {
            env: Arc::new(Mutex::new(env)),
            tools,
        }
    }
}

impl ServerHandler for DomainServer {
    fn get_info(&self) -> ServerConfig {
        let name = self
            .env
            .lock()
            .map(|e| e.domain().name().to_string())
            .unwrap_or_default();
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new(
                format!("envace-{name}"),
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(format!(
                "The envace `{name}` domain: a deterministic in-memory world."
            ))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(
            self.tools.iter().map(to_mcp_tool).collect(),
        ))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let call = ToolCall {
            name: request.name.to_string(),
            arguments: request
                .arguments
                .map_or_else(|| Value::Object(Default::default()), Value::Object),
        };
        let resp = {
            let mut env = self
                .env
                .lock()
                .map_err(|_| ErrorData::internal_error("environment lock poisoned", None))?;
            env.call_sync(&call)
                .map_err(|e| ErrorData::internal_error(e.to_string(), None))?
        };
        Ok(CallToolResponse::Complete(to_mcp_result(&resp)))
    }
}

/// Serve `env` on stdin/stdout until the client disconnects.
pub async fn serve_stdio(env: DomainEnv) -> Result<(), EnvError> {
    let name = env.domain().name().to_string();
    let err = |message: String| EnvError::Mcp {
        server: format!("envace-{name}"),
        message,
    };
    let service = DomainServer::new(env)
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| err(format!("handshake failed: {e}")))?;
    service
        .waiting()
        .await
        .map_err(|e| err(format!("server task failed: {e}")))?;
    Ok(())
}
