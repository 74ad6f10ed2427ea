//! Circles in a directed graph, each reported once with a path around it.

use std::collections::{BTreeMap, BTreeSet};

/// Node → the nodes it points at.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// One message per strongly connected component of more than one node: `what` form a circle, and one way
/// around it.
pub fn circles(g: &Graph, what: &str) -> Vec<String> {
    components(g)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| {
            let way = around(g, &c);
            format!("{what} form a circle: {}", way.join(" → "))
        })
        .collect()
}

/// Strongly connected components (Tarjan), each as its set of nodes.
fn components(g: &Graph) -> Vec<BTreeSet<String>> {
    struct State<'g> {
        g: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low[v];
                s.low.insert(v, lv.min(lw));
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low[v];
                s.low.insert(v, lv.min(iw));
            }
        }
        if s.low[v] == s.index[v] {
            let mut c = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                c.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            s.out.push(c);
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// A shortest way from the component's first node back to itself, inside the component.
fn around(g: &Graph, c: &BTreeSet<String>) -> Vec<String> {
    let Some(start) = c.iter().next() else {
        return Vec::new();
    };
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start.as_str()]);
    while let Some(v) = queue.pop_front() {
        for w in g.get(v).into_iter().flatten().filter(|w| c.contains(*w)) {
            if w == start {
                let mut way = vec![start.clone(), v.to_string()];
                let mut at = v;
                while let Some(&p) = came_from.get(at) {
                    way.push(p.to_string());
                    at = p;
                }
                way.reverse();
                return way;
            }
            if !came_from.contains_key(w.as_str()) {
                came_from.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    c.iter().cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::{Graph, circles};

    fn g(edges: &[(&str, &str)]) -> Graph {
        let mut g = Graph::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
        }
        g
    }

    #[test]
    fn a_circle_is_found_once_and_walked() {
        let found = circles(&g(&[("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]), "x");
        assert_eq!(found, ["x form a circle: a → b → c → a"]);
        assert!(circles(&g(&[("a", "b"), ("d", "b")]), "x").is_empty());
    }
}
