// Entry point of chat.html.
import { startChatPage } from './chat-page.js';

startChatPage();
